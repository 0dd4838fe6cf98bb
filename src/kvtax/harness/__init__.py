"""The measurement harness: plan cells, run each in a fresh process, append rows, analyse.

Subpackages by job: `bench` (plan, sweep, executor, worker, cells, per-phase memory and
clocks), `engines` (one interface over kvtax, transformers, llama.cpp, mlx-lm, servers),
`recall` and `quality` (the two probes), `analysis` (statistics, claims, verdict, capacity,
roofline) and `report` (markdown, plots). `schema` (the row format) and `store` (run
folders) are shared by all of them. Nothing heavy is imported here, so `import
kvtax.harness.schema` stays cheap.
"""
