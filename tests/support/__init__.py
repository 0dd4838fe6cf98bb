"""Shared code of the tests (not tests themselves): tensor comparisons, kernel test cases,
the fake engine and its environments, a local OpenAI-compatible server, planted rows.
The interpreter and device setup is tests/conftest.py's."""
