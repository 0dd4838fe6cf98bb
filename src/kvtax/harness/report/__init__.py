"""Run reports: report.md, its figures and analysis.json, and two runs side by side."""
