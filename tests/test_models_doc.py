"""docs/models.md is generated from the policy registry (scripts/gen_models_doc.py) and must not go stale."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_models_doc", ROOT / "scripts" / "gen_models_doc.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_models_doc_is_up_to_date():
    gen = _generator()
    expected = gen.render()
    current = (ROOT / "docs" / "models.md").read_text()
    assert current == expected, "docs/models.md is stale: run `python scripts/gen_models_doc.py`"


def test_models_doc_lists_every_registered_family_with_its_policy():
    from hf_dsinfer.integration.support import TESTED_ARCHITECTURES, registered_policies

    text = (ROOT / "docs" / "models.md").read_text()
    rows = {line.split("|")[1].strip().strip("`"): line for line in text.splitlines() if line.startswith("| `")}
    policies = registered_policies()
    assert set(rows) == set(policies) | set(TESTED_ARCHITECTURES)
    for model_type, policy in policies.items():
        cells = [c.strip() for c in rows[model_type].split("|")[1:-1]]
        assert cells[1] == "fused" and cells[2] == type(policy).__name__, rows[model_type]


def test_models_doc_check_flag_reports_a_stale_page(tmp_path, monkeypatch, capsys):
    gen = _generator()
    page = "# Supported models\n\n| model_type | Path |\n"
    monkeypatch.setattr(gen, "render", lambda: page)  # the real render is compared above; this checks --check
    stale = tmp_path / "models.md"
    stale.write_text("# Supported models\n")
    monkeypatch.setattr(gen, "DOC_PATH", stale)
    assert gen.main(["--check"]) == 1
    assert "+| model_type | Path |" in capsys.readouterr().out
    assert stale.read_text() == "# Supported models\n"  # --check never writes
    assert gen.main([]) == 0 and stale.read_text() == page
    assert gen.main(["--check"]) == 0
