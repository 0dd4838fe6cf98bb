"""The measurement harness: plan cells, run each in a fresh process, append rows, analyse.

Modules: `schema` (row format), `store` (run folders), `plan` (cells and their order),
`worker`/`sweep` (isolated execution), `cells` (what a cell measures), `memory` and
`devinfo` (per-phase peaks, clocks), `stats`/`claims`/`capacity` (analysis), `roofline`.
Nothing heavy is imported here, so `import kvtax.harness.schema` stays cheap.
"""
