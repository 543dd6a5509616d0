"""A powered, pre-registered mixture study (issue 34; docs/design.md section 4e): the design
(design.py), its statistics (stats.py), run directories paired by seed (runs.py), the
calibration and its go/no-go gate (calibration.py), the verdict table (verdict.py) and the
command that recomputes it from the raw logs (summarize.py, cli.py); and `doremi compare`
(compare.py), mixtures against a baseline over several seeds by the same paired test."""
