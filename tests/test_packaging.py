"""The framework's `trainer` and `data` packages are found even where a user's own `trainer.py`
or `data/` sits in the working directory (`python -m doremi` puts it first on sys.path), and a
foreign module of those names imported before doremi is refused with one clear line."""

from __future__ import annotations

import subprocess
import sys


def _shadowing_dir(tmp_path):
    (tmp_path / "trainer.py").write_text("raise SystemExit('the user trainer.py was imported')\n")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "__init__.py").write_text("raise SystemExit('the user data package was imported')\n")
    return tmp_path


def test_python_m_doremi_is_not_shadowed_by_the_working_directory(tmp_path):
    res = subprocess.run(
        [sys.executable, "-m", "doremi", "--help"],
        cwd=_shadowing_dir(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr
    assert "usage: doremi" in res.stdout


def test_a_foreign_trainer_imported_first_is_refused(tmp_path):
    (tmp_path / "trainer.py").write_text("VALUE = 1\n")
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); import trainer; import doremi"
    res = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith(f"ImportError: doremi: a module named 'trainer' from {tmp_path / 'trainer.py'} was imported")
