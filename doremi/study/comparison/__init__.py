"""The comparison of every mixing method on the powered study's design (issue 39; docs/design.md
section 4f): the pre-registered protocol (`protocol.py`), the 2-epoch rule as arithmetic on a
plan (`epochs.py`), the two views of cost (`cost.py`), the stages with their price and FLOPs
(`plan.py`) from the study's measured stage times (`price.py`). The launcher is
experiments/launch/comparison.py; the prose, experiments/notes/COMPARISON.md."""
