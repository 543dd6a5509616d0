"""The method catalog (issue 35 item 1; doremi/methods/registry.py, docs/design.md section 2): a
method is its folder plus one registry line. A method written here as a new package alone, with
one line added to `CATALOG`, trains as a proxy under tp2 pp2 dp2 on CPU and logs its weights; no
code outside a method's folder and the registry names a method; DoReMi's options moved from the
top-level `doremi` section to `mixing.doremi`, the old keys refused with a line naming the new one."""

from __future__ import annotations

import ast
import json
import re
import textwrap
from pathlib import Path

import pytest

from doremi.methods import registry

ROOT = Path(__file__).resolve().parents[1]

#: The new method, written to a temporary directory as a package of its own: a config with one
#: option, a hook that draws every domain in proportion to its share `tilt ** i`, and its spec.
PACKAGE = "tilted_catalog_method"
FILES = {
    "__init__.py": '''
        """A method that exists only in this test's folder: its spec, the registry's only contact."""

        from tilted_catalog_method.config import TiltedConfig
        from doremi.methods.spec import ONLINE, PROXY, MethodSpec, Reads


        def build(cfg, ctx):
            from tilted_catalog_method.method import Tilted

            return Tilted(cfg.mixing.tilted, ctx)


        SPEC = MethodSpec(
            name="tilted",
            cite="a test's method",
            reads=Reads(training_batches=True),
            roles=(PROXY, ONLINE),
            config=TiltedConfig,
            build=build,
        )
    ''',
    "config.py": '''
        from dataclasses import dataclass


        @dataclass
        class TiltedConfig:
            """The tilted method's one option."""

            # Domain i is drawn in proportion to tilt ** i.
            tilt: float = 2.0
    ''',
    "method.py": """
        import numpy as np

        from doremi.methods.log import MethodLog
        from trainer.run.hooks import MethodBase, Needs


        class Tilted(MethodBase):
            needs = Needs()

            def __init__(self, cfg, ctx):
                p = np.array([cfg.tilt**i for i in range(ctx.k)])
                self.p, self.log = p / p.sum(), MethodLog(ctx)

            def sampling_weights(self, step):
                return self.p

            def after_step(self, step, signals):
                self.log.append(step, {"weights": self.p.tolist(), "tokens": signals.tokens.tolist()})
                return {}

            def close(self):
                self.log.close()
    """,
}
LINE = f"{PACKAGE}"
LAYOUT = [
    "parallelism.tp=2",
    "parallelism.pp=2",
    "parallelism.dp=2",
    "parallelism.sequence_parallel=true",
    "train.micro_batches=2",
]


def write_package(root: Path) -> None:
    (root / PACKAGE).mkdir()
    for name, text in FILES.items():
        (root / PACKAGE / name).write_text(textwrap.dedent(text).lstrip())


def proxy_worker(rank: int, world: int, package_root: str, store: str, run: str) -> None:
    """One of the 8 processes: the registry line added, what is derived from the catalog derived
    again (the ranks fork from a server that imported the framework, tests/distributed.py
    PRELOAD), then the proxy trained."""
    import importlib
    import sys

    import doremi.config

    sys.path.insert(0, package_root)
    registry.CATALOG = (*registry.CATALOG, LINE)
    importlib.reload(doremi.config)
    from doremi.pipeline import stages
    from tests.runs import config

    sets = ["train.steps=3", "train.decay=constant", "train.warmup_steps=0", "mixing.method=tilted"]
    stages.train_proxy(config(Path(store), Path(run), *sets, "mixing.tilted.tilt=3", *LAYOUT))


@pytest.mark.usefixtures("one_thread")
def test_a_method_added_as_one_folder_and_one_registry_line_trains_under_tp2_pp2_dp2(stores, tmp_path, monkeypatch):
    from doremi.methods.history import read_history
    from tests.distributed import spawn

    write_package(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "CATALOG", (*registry.CATALOG, LINE))
    spec = registry.spec("tilted")
    assert (spec.roles, registry.reads("tilted").describe()) == (("proxy", "online"), "training batches' losses")
    assert "tilted" in registry.names("proxy") and "tilted" in registry.names("online")

    run = tmp_path / "run"
    spawn(proxy_worker, 8, str(tmp_path), str(stores), str(run))
    history = read_history(run)
    assert [h["step"] for h in history] == [1, 2, 3]
    k = len(history[0]["weights"])
    expected = [3.0**i / sum(3.0**j for j in range(k)) for i in range(k)]
    assert all(h["weights"] == pytest.approx(expected, abs=1e-12) for h in history)
    assert json.loads((run / "run.json").read_text())["stage"] == "proxy"


#: An offline method as a package of its own: its fit proposes the sweep's run with the lowest
#: target loss, and records how many runs it chose from.
OFFLINE_PACKAGE = "best_run_catalog_method"
OFFLINE_INIT = '''
    """An offline method that exists only in this test's folder: its spec and its fit."""

    import numpy as np

    from doremi.methods.spec import OFFLINE, MethodSpec, Reads
    from doremi.offline.fit.table import FitResult


    def fit(cfg, table):
        target = table.per_domain @ table.target
        best = int(np.argmin(target))
        return FitResult(table.weights[best], float(target[best]), None, "chosen, not fitted", record={"best_run": best})


    SPEC = MethodSpec(
        name="best_run",
        cite="a test's fit",
        reads=Reads(sweep_losses=True, validation=("sweep_run",)),
        roles=(OFFLINE,),
        fit=fit,
    )
'''


def test_an_offline_method_added_as_one_folder_and_one_registry_line_is_fitted(stores, tmp_path, monkeypatch):
    """`doremi fit --method best_run` on a two-run sweep: doremi/offline/propose.py reads the
    sweep and writes the new method's proposal, naming no method itself. Run 1's mean loss
    (2 + 2.5 + 3) / 3 = 2.5 is below run 0's (4 + 3 + 2) / 3 = 3, so its mixture is proposed."""
    from doremi.commands.cli import main
    from tests.runs import config_path
    from tests.test_sweep_fit_inputs import ROW0, write_sweep

    (tmp_path / OFFLINE_PACKAGE).mkdir()
    (tmp_path / OFFLINE_PACKAGE / "__init__.py").write_text(textwrap.dedent(OFFLINE_INIT).lstrip())
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "CATALOG", (*registry.CATALOG, OFFLINE_PACKAGE))
    assert registry.names("offline")[-1] == "best_run" and registry.reads("best_run").describe() == (
        "dev validation (sweep_run), a sweep's losses"
    )
    row1 = ["1", "dirichlet", "0.5", "0.5", "0.0", "2.0", "2.5", "3.0", "2.5", "3.0"]
    sweep = write_sweep(tmp_path / "sweep", [ROW0, row1])
    out = tmp_path / "best.json"
    path = str(config_path(stores, tmp_path / "cfg"))
    assert main(["fit", path, "--method", "best_run", "--sweep", str(sweep), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert (doc["method"], doc["weights"], doc["predicted_loss"]) == ("best_run", [0.5, 0.5, 0.0], 2.5)
    assert (doc["best_run"], doc["held_out_skipped"], doc["n_runs"]) == (1, "chosen, not fitted", 2)


# -- no method named outside its folder and the registry ---------------------------------------------

#: Where a method may be named: its folder, the registry; the offline fits too (their fit is their
#: spec's `fit`, doremi/offline/propose.py names none). The framework is scanned; experiments/
#: runs chosen methods, as a config or the docs name them.
SCANNED = ("doremi", "trainer", "data")
#: Files that name a method on purpose, and why.
ALLOWED = {
    "doremi/__init__.py": "the package's documented API re-exports DoReMi's pure update functions",
    "doremi/study/design.py": "the pre-registered DoReMi study names the arms it compares",
    "doremi/study/comparison/protocol.py": "the pre-registered comparison names its arms and their methods' options",
}

#: Uses that are not the method's: the program and the package are named `doremi` too.
NOT_A_METHOD = (
    re.compile(r'"-m", "doremi"'),  # `python -m doremi`
    re.compile(r'prog="doremi"'),
    re.compile(r'shlex.join\(\["doremi"'),  # the command line a pipeline records
    re.compile(r'(wandb_project|project): str = "doremi"'),  # the wandb project
    re.compile(r'prefix: str = "doremi"'),  # the program's name on its warnings
    re.compile(r'PACKAGES = \("data", "trainer", "doremi"\)'),  # the packages a code identity hashes
)


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr):
            if isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def method_uses(path: Path, names: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, name) of each use of a method `name` in a Python file: a string equal to it or
    naming its options (`mixing.<name>`), an attribute of that name (`cfg.mixing.doge`), or an
    import of its folder's modules; docstrings are docs, and the program's name is no method."""
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        hit = None
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            hit = next((n for n in names if node.value == n or re.search(rf"\bmixing\.{n}\b", node.value)), None)
        elif isinstance(node, ast.Attribute):
            hit = node.attr if node.attr in names else None
        elif isinstance(node, ast.ImportFrom) and node.module:
            hit = next((n for n in names if node.module.startswith(f"doremi.methods.{n}")), None)
        if hit and not any(p.search(lines[node.lineno - 1]) for p in NOT_A_METHOD):
            found.append((node.lineno, hit))
    return found


def uses_outside_the_catalog() -> list[str]:
    specs = registry.specs()
    names = tuple(specs)
    homes = {n: f"doremi/methods/{n}/" for n in names}
    out = []
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel == "doremi/methods/registry.py" or rel in ALLOWED:
                continue
            for line, name in method_uses(path, names):
                if not rel.startswith(homes[name]):
                    out.append(f"{rel}:{line}: {name}")
    return out


def test_the_scan_finds_each_kind_of_use(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        textwrap.dedent(
            '''
            """Docs may name doge."""
            from doremi.methods.odm.method import ODM
            import doremi
            x = cfg.mixing.aioli
            if name == "ado":
                k = "mixing.doge.mu"
            cmd = [sys.executable, "-m", "doremi", "train"]
            '''
        )
    )
    assert method_uses(path, ("doremi", "doge", "odm", "aioli", "ado")) == [
        (3, "odm"),
        (5, "aioli"),
        (6, "ado"),
        (7, "doge"),
    ]


def test_no_method_is_named_outside_its_folder_and_the_registry():
    assert uses_outside_the_catalog() == []


# -- DoReMi's options moved ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, line",
    [
        ("doremi:\n  eta: 2\n", "doremi.eta: moved to mixing.doremi.eta"),
        ("doremi: {reference_weights: tokens}\n", "doremi.reference_weights: moved to mixing.doremi.reference_weights"),
        ("doremi: {}\n", "doremi: moved to mixing.doremi"),
    ],
)
def test_the_old_doremi_section_is_refused_with_the_new_key(tmp_path, capsys, text, line):
    from doremi.commands.cli import main

    path = tmp_path / "old.yaml"
    path.write_text(text)
    assert main(["config", str(path)]) == 2
    assert capsys.readouterr().err.splitlines() == [f"doremi config: error: {line}"]


def test_an_old_key_given_with_set_is_refused_too(tmp_path, capsys):
    from doremi.commands.cli import main

    path = tmp_path / "c.yaml"
    path.write_text("train: {steps: 3}\n")
    assert main(["config", str(path), "--set", "doremi.smoothing=0.1"]) == 2
    assert capsys.readouterr().err.strip() == "doremi config: error: doremi.smoothing: moved to mixing.doremi.smoothing"


def test_a_run_saved_before_the_move_is_read_and_keeps_its_fingerprint(stores, tmp_path):
    """A finished run's config.yaml with the top-level section: read as written, and its record
    keys (and so its fingerprint) name the section as it was written then."""
    import yaml

    from doremi.config import load_saved_config
    from tests.runs import config
    from trainer.config.tools import to_dict
    from trainer.records.run_dir import record

    new = to_dict(config(stores, tmp_path / "run", "mixing.doremi.eta=0.5"))
    old = {k: v for k, v in new.items() if k != "mixing"}
    old["doremi"] = new["mixing"]["doremi"]
    old["mixing"] = {k: v for k, v in new["mixing"].items() if k != "doremi"}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(old))
    cfg = load_saved_config(tmp_path / "config.yaml")
    assert cfg.mixing.doremi.eta == 0.5
    keys = record(cfg)["keys"]
    assert keys["doremi.eta"] == 0.5 and not any(k.startswith("mixing.doremi") for k in keys)
    assert record(cfg) == record(config(stores, tmp_path / "run", "mixing.doremi.eta=0.5"))
