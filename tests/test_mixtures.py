import numpy as np
import pytest

from data.errors import DataError
from data.sampling.mixtures import (
    MixtureSpec,
    is_mixture_name,
    parse_mixture,
    temperature_weights,
    unimax_allocation,
    unimax_weights,
)
from data.sampling.weights import NAMED_MIXTURES, check_spec, resolve_weights
from doremi.outputs.main_runs import main_run_name, mixtures
from tests.test_data_weights import manifest

MANIFEST = manifest({"a": 100, "b": 400, "c": 900})
DOMAINS = ["a", "b", "c"]


def close(got, want, tol=1e-12):
    return np.allclose(np.asarray(got), np.asarray(want, dtype=np.float64), rtol=0, atol=tol)


def test_temperature_hand_cases():
    # w_i ∝ n_i^(1/T): T = 2 -> sqrt(100), sqrt(400) = 10, 20 -> 1/3, 2/3.
    assert close(temperature_weights([100, 400], 2), [1 / 3, 2 / 3])
    # T = 1: the natural mixture.
    assert close(temperature_weights([100, 400], 1), [0.2, 0.8])
    # T = 0.5: squares, 1e4 and 16e4 -> 1/17, 16/17.
    assert close(temperature_weights([100, 400], 0.5), [1 / 17, 16 / 17])
    # Three domains, T = 2: 10, 20, 30 -> 1/6, 2/6, 3/6.
    assert close(temperature_weights([100, 400, 900], 2), [1 / 6, 2 / 6, 3 / 6])
    # A domain with no tokens gets none; large T tends to uniform over the rest.
    assert close(temperature_weights([0, 100, 400], 1e6), [0, 0.5, 0.5], 1e-6)
    # A small T does not overflow: (n_i / max n)^(1/T), the largest domain takes everything.
    w = temperature_weights([1e9, 2e9], 0.001)
    assert np.all(np.isfinite(w)) and close(w, [0, 1])


def test_unimax_hand_cases():
    # Budget 1000, E = 3, n = 100, 400. Smallest first: min(1000/2, 3*100) = 300 (the cap binds);
    # remaining 700 to the last: min(700/1, 3*400 = 1200) = 700 (the cap does not bind).
    assert close(unimax_allocation([100, 400], 1000, 3), [300, 700])
    assert close(unimax_weights([100, 400], 1000, 3), [0.3, 0.7])
    # Domain order does not matter: visited by size, returned in the given order.
    assert close(unimax_weights([400, 100], 1000, 3), [0.7, 0.3])
    # No cap binds: budget 400, E = 4: min(200, 400) = 200, min(200, 1600) = 200 -> uniform.
    assert close(unimax_weights([100, 400], 400, 4), [0.5, 0.5])
    # Three domains, budget 1500, E = 2: a: min(500, 200) = 200; b: min(1300/2 = 650, 800) = 650;
    # c: min(650, 1800) = 650 -> 200, 650, 650 of 1500.
    assert close(unimax_allocation([100, 400, 900], 1500, 2), [200, 650, 650])
    assert close(unimax_weights([100, 400, 900], 1500, 2), [200 / 1500, 650 / 1500, 650 / 1500])
    # Fractional epochs: E = 0.5, budget 600: a: min(200, 50) = 50; b: min(275, 200) = 200;
    # c: min(350, 450) = 350.
    assert close(unimax_allocation([100, 400, 900], 600, 0.5), [50, 200, 350])
    # A domain with no tokens is capped at 0.
    assert close(unimax_weights([0, 100, 400], 1000, 3), [0, 0.3, 0.7])


def test_unimax_budget_over_every_cap_is_natural():
    # Budget 2000 > E * sum(n) = 1 * 1400: every cap binds, U = n, and the paper's normalize(U)
    # gives the natural mixture (every domain repeats 2000/1400 epochs: over E, evenly).
    assert close(unimax_allocation([100, 400, 900], 2000, 1), [100, 400, 900])
    assert close(unimax_weights([100, 400, 900], 2000, 1), [100 / 1400, 400 / 1400, 900 / 1400])
    # Exactly at the caps: the same.
    assert close(unimax_weights([100, 400, 900], 1400, 1), [100 / 1400, 400 / 1400, 900 / 1400])


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: temperature_weights([1, 2], 0), "temperature: expected a finite number > 0"),
        (lambda: temperature_weights([1, 2], float("inf")), "temperature: expected a finite number > 0"),
        (lambda: temperature_weights([0, 0], 2), "every domain has 0 train tokens"),
        (lambda: temperature_weights([1, -1], 2), "expected finite numbers >= 0"),
        (lambda: unimax_weights([1, 2], 0, 1), "unimax: expected a token budget > 0"),
        (lambda: unimax_weights([1, 2], 10, 0), "unimax: expected max epochs > 0"),
        (lambda: unimax_weights([0, 0], 10, 1), "every domain has 0 train tokens"),
    ],
)
def test_pure_function_errors(call, message):
    with pytest.raises(DataError, match=message):
        call()


def test_parse_forms():
    assert parse_mixture("uniform", "k") == MixtureSpec("uniform")
    assert parse_mixture("tokens", "k") == MixtureSpec("tokens")
    assert parse_mixture("temperature:2", "k") == MixtureSpec("temperature", 2.0)
    assert parse_mixture("temperature:1.5", "k") == MixtureSpec("temperature", 1.5)
    assert parse_mixture("unimax:4", "k") == MixtureSpec("unimax", 4.0)
    assert parse_mixture("unimax:.5", "k") == MixtureSpec("unimax", 0.5)
    assert parse_mixture("temperature:1e1", "k") == MixtureSpec("temperature", 10.0)
    assert parse_mixture("temperature:2.0", "k").name == "temperature:2"
    for name in ("uniform", "tokens", "temperature:2", "unimax:x", "temperature", "unimax:"):
        assert is_mixture_name(name) and name in NAMED_MIXTURES
    for other in ("w.json", "runs/temperature.json", "Uniform", 3, ["uniform"], None):
        assert not is_mixture_name(other) and other not in NAMED_MIXTURES
    assert list(NAMED_MIXTURES) == ["uniform", "tokens", "temperature", "unimax"]


@pytest.mark.parametrize(
    "bad",
    [
        "temperature:x",
        "temperature",
        "temperature:",
        "temperature:0",
        "temperature:-1",
        "temperature:inf",
        "temperature:nan",
        "temperature: 2",
        "temperature:2:3",
        "unimax:0",
        "unimax:1e999",
        "unimax:four",
    ],
)
def test_bad_forms(bad):
    expected = (
        "data.domain_weights: expected uniform, tokens, temperature:T (T > 0), unimax:E (E > 0), "
        f"a weights file or values; got {bad!r}"
    )
    with pytest.raises(DataError) as e:
        parse_mixture(bad, "data.domain_weights")
    assert str(e.value) == expected
    with pytest.raises(DataError) as e:
        check_spec(bad, DOMAINS, "data.domain_weights")
    assert str(e.value) == expected
    with pytest.raises(DataError) as e:
        check_spec(bad, None, "data.domain_weights")
    assert str(e.value) == expected
    with pytest.raises(DataError) as e:
        resolve_weights(bad, MANIFEST, budget_tokens=1000)
    assert str(e.value) == expected


def test_check_spec_accepts_the_names():
    for name in ("uniform", "tokens", "temperature:2", "temperature:1.5", "unimax:4"):
        check_spec(name, DOMAINS, "pipeline.baselines[0]")
        check_spec(name, None, "mixing.doremi.proxy_sampling")


def test_resolve_weights_names():
    assert resolve_weights("uniform", MANIFEST).tolist() == [1 / 3] * 3
    assert resolve_weights("tokens", MANIFEST).tolist() == [100 / 1400, 400 / 1400, 900 / 1400]
    assert close(resolve_weights("temperature:2", MANIFEST), [1 / 6, 2 / 6, 3 / 6])
    # The budget is ignored by the forms that do not need it.
    assert close(resolve_weights("temperature:2", MANIFEST, budget_tokens=5), [1 / 6, 2 / 6, 3 / 6])
    w = resolve_weights("unimax:2", MANIFEST, "data.domain_weights", budget_tokens=1500)
    assert isinstance(w, np.ndarray) and w.dtype == np.float64
    assert close(w, [200 / 1500, 650 / 1500, 650 / 1500])


def test_unimax_without_budget_names_the_key():
    with pytest.raises(DataError) as e:
        resolve_weights("unimax:4", MANIFEST, "mixing.doremi.proxy_sampling")
    message = str(e.value)
    assert message.startswith("mixing.doremi.proxy_sampling: unimax:4 needs the run's token budget")
    assert "\n" not in message


def test_main_run_names():
    assert main_run_name("uniform") == "uniform"
    assert main_run_name("tokens") == "tokens"
    assert main_run_name("temperature:2") == "temperature2"
    assert main_run_name("temperature:2.0") == "temperature2"
    assert main_run_name("temperature:1.5") == "temperature1.5"
    assert main_run_name("unimax:4") == "unimax4"
    assert main_run_name("unimax:0.25") == "unimax0.25"
    assert main_run_name("/some/dir/mix.json") == "mix"
    # A bad form still gets a name (check_spec refuses it with its key).
    assert main_run_name("temperature:x") == "temperaturex"
    assert mixtures("w.json", ["uniform", "temperature:2", "unimax:4"]) == {
        "doremi": "w.json",
        "uniform": "uniform",
        "temperature2": "temperature:2",
        "unimax4": "unimax:4",
    }


def test_epoch_capped_hand_cases():
    from data.sampling.mixtures import epoch_capped

    tokens, budget = [100, 400, 900], 1000  # caps at 1 epoch: 0.1, 0.4, 0.9
    # a over: 0.1; b, c share 0.9 as 0.3 : 0.2 -> 0.54, 0.36; b over: 0.4; c takes the rest 0.5.
    np.testing.assert_allclose(epoch_capped([0.5, 0.3, 0.2], tokens, budget, 1.0), [0.1, 0.4, 0.5], rtol=0, atol=1e-15)
    within = np.array([0.05, 0.35, 0.6])
    assert np.array_equal(epoch_capped(within, tokens, budget, 1.0), within)
    np.testing.assert_allclose(epoch_capped([0.5, 0.5, 0.0], tokens, budget, 2.0), [0.2, 0.8, 0.0], atol=1e-15)
    with pytest.raises(DataError, match="too few"):
        epoch_capped([0.6, 0.4, 0.0], tokens, budget, 1.0)


def test_sequence_capped_counts_sequences_with_one_of_slack():
    from data.sampling.mixtures import sequence_capped

    # pools of 101, 401, 900 sequences, a run of 1000: caps (E n - 1) / S = 0.1, 0.4, 0.899
    np.testing.assert_allclose(
        sequence_capped([0.5, 0.3, 0.2], [101, 401, 900], 1000, 1.0), [0.1, 0.4, 0.5], atol=1e-15
    )
    np.testing.assert_allclose(sequence_capped([0.05, 0.05, 0.9], [101, 401, 900], 1000, 1.0), [0.0505, 0.0505, 0.899])
    with pytest.raises(DataError, match="too few"):
        sequence_capped([0.5, 0.5, 0.0], [101, 401, 900], 1000, 1.0)
