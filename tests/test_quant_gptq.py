"""GPTQ (calibrated int4 / int8): the algorithm on small random problems, and the ``quant.weight.calibration``
setting. The real-model quality bounds are in tests/test_quant_real.py."""

import pytest
import torch
from hf_dsinfer.kernels import quant_format as qf
from hf_dsinfer.kernels.quant_format import QuantSpec, dequantize_weight, quantize_weight

from hf_dsinfer.integration.quant_calibration import CALIBRATION_DEFAULTS, parse_calibration
from hf_dsinfer.integration.quant_config import parse_quant, quantize_fused_layers_, quantize_slices

SPECS = [QuantSpec(4, 64, False), QuantSpec(4, 64, True), QuantSpec(4, 100, False), QuantSpec(8, 256, True)]


def _problem(seed: int = 0, n: int = 24, k: int = 256):
    """A weight and inputs whose features have very different scales (what makes GPTQ beat round-to-nearest)."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)  # [N, K]
    x = torch.randn(512, k, generator=g) * torch.linspace(0.05, 3.0, k)  # [tokens, K]
    return w, x, x.t() @ x / x.shape[0]


def _output_error(q, spec, w, x) -> float:
    deq = dequantize_weight(*q, spec, w.shape[1], torch.float32)
    return ((x @ (deq - w).t()) ** 2).mean().item() / ((x @ w.t()) ** 2).mean().item()


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_gptq_with_identity_hessian_rounds_to_nearest_on_its_ranges(spec):
    # H = I: no column's error moves another, so every weight is rounded to nearest against the group ranges GPTQ
    # fixed up front (its clipping search, weighted by diag(H) = 1)
    w, _, _ = _problem()
    qw, scale, zero = quantize_weight(w, spec, hessian=torch.eye(w.shape[1]), damp=0.0)
    g = qf._grouped(w, spec.group_size)
    ones = torch.ones(1, w.shape[1])  # diag(H), the ragged last group's padding columns weighing nothing
    importance = qf._grouped(torch.cat([ones, torch.zeros(1, -w.shape[1] % spec.group_size)], 1), spec.group_size)
    s, z = qf._clipped_group_params(g, spec, torch.float32, importance)
    codes = qf._codes(g, s, z, spec).reshape(w.shape[0], -1)[:, : w.shape[1]]
    assert torch.equal(scale, s) and (zero is None or torch.equal(zero, z))
    assert torch.equal(qw, qf._pack(codes, spec))


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_clipping_search_never_loses_to_min_max(spec):
    w, _, _ = _problem(3)
    w[:, 5] *= 6.0  # an outlier column: clipping it buys a finer step for the rest of its group
    g = qf._grouped(w, spec.group_size)
    importance = torch.rand(g.shape, generator=torch.Generator().manual_seed(0))

    def err(s, z):
        return ((qf._decoded(qf._codes(g, s, z, spec), s, z, spec) - g) ** 2 * importance).sum(-1)  # [N, G]

    plain = err(*qf._group_params(g, spec, torch.float32))
    clipped_s, clipped_z = qf._clipped_group_params(g, spec, torch.float32, importance)
    clipped = err(clipped_s, clipped_z)
    assert (clipped <= plain).all()
    if spec.num_bits == 4:  # 16 levels: the outlier's group clips in most rows (int8's 255 rarely need to)
        assert (clipped[:, 0] < plain[:, 0]).float().mean() > 0.5
    assert (clipped_s <= qf._group_params(g, spec, torch.float32)[0]).all()  # ranges only ever shrink


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_gptq_lowers_the_output_error(spec):
    w, x, h = _problem()
    rtn = _output_error(quantize_weight(w, spec), spec, w, x)
    gptq = _output_error(quantize_weight(w, spec, hessian=h), spec, w, x)
    assert gptq < 0.8 * rtn, (gptq, rtn)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_gptq_row_slices_quantize_like_the_whole(spec):
    # column-parallel TP slices rows: each rank must get the rows of the tp=1 result
    w, _, h = _problem(1)
    whole = quantize_weight(w, spec, hessian=h)
    part = quantize_weight(w[5:17], spec, hessian=h)
    for a, b in zip(whole, part):
        assert (a is None and b is None) or torch.equal(a[5:17], b)


def test_gptq_dead_inputs_and_bad_hessian():
    w, x, h = _problem(2)
    h[:, 7] = 0.0
    h[7, :] = 0.0  # an input that is always 0
    q = quantize_weight(w, QuantSpec(4, 64, False), hessian=h)
    assert all(torch.isfinite(t.float()).all() for t in q if t is not None)
    with pytest.raises(ValueError, match=r"hessian must be \[256, 256\]"):
        quantize_weight(w, QuantSpec(4, 64, False), hessian=torch.eye(8))


def test_calibration_setting_parsed_and_saved(tmp_path):
    text = tmp_path / "calib.txt"
    text.write_text("Some text to calibrate on.")
    settings = parse_quant({"weight": {"num_bits": 4, "calibration": "gptq"}})
    assert settings.calibration == CALIBRATION_DEFAULTS
    assert settings.to_dict()["weight"]["calibration"] == CALIBRATION_DEFAULTS  # written to config.json
    assert parse_quant(settings.to_dict()) == settings  # and read back the same
    assert "GPTQ" in settings.describe()
    custom = parse_calibration({"dataset": str(text), "num_samples": 4, "seq_len": 64, "damp_percent": 0.05})
    assert custom == {"method": "gptq", "dataset": str(text), "num_samples": 4, "seq_len": 64, "damp_percent": 0.05}
    assert parse_calibration({"dataset": ("a b c", "d e f")})["dataset"] == ["a b c", "d e f"]
    assert parse_calibration(None) is None and parse_calibration(False) is None


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"num_sample": 4}, r"Unknown quant.weight.calibration key 'num_sample'. Did you mean 'num_samples'\?"),
        ({"method": "awq"}, r"calibration.method must be one of gptq"),
        ({"seq_len": 0}, r"calibration.seq_len must be an integer >= 1"),
        ({"damp_percent": 2}, r"damp_percent must be a number in \(0, 1\)"),
        ({"dataset": "/no/such/file.txt"}, r"is not a file"),
        ({"dataset": [1, 2]}, r"dataset must be None"),
        (3, r"calibration must be a dict"),
    ],
)
def test_calibration_errors_name_the_key(value, match):
    with pytest.raises(ValueError, match=match):
        parse_quant({"weight": {"num_bits": 4, "calibration": value}})


def test_calibration_refused_where_it_cannot_run():
    settings = parse_quant({"weight": {"num_bits": 4, "calibration": "gptq"}})
    with pytest.raises(ValueError, match="calibration.*not supported with tensor parallelism"):
        quantize_slices(settings)
    with pytest.raises(ValueError, match="calibration.*Hybrid Engine"):
        quantize_fused_layers_(torch.nn.ModuleList(), settings)


def test_int4_without_calibration_is_advised_once(monkeypatch):
    from hf_dsinfer import log
    from hf_dsinfer.integration.quant_config import advise_calibration

    warned: list[str] = []  # recorded at the logger itself: another test may have turned propagation to caplog off
    monkeypatch.setattr(log, "_WARNED", set())
    monkeypatch.setattr(log.logger, "warning", lambda msg, *a, **k: warned.append(msg % a if a else msg))
    advise_calibration(parse_quant({"weight": {"num_bits": 8}}))
    advise_calibration(parse_quant({"weight": {"num_bits": 4, "q_type": "asymmetric", "calibration": "gptq"}}))
    assert warned == []  # int8, or int4 already calibrated: nothing to advise
    for _ in range(2):
        advise_calibration(parse_quant({"weight": {"num_bits": 4}}))
    assert len(warned) == 1 and "quant.weight.calibration='gptq'" in warned[0]
