"""docs/configuration.md lists every TpserveConfig field (a field added without its row fails)."""

from __future__ import annotations

from pathlib import Path

from deployments.config import TpserveConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def test_every_config_field_has_a_row():
    rows = {line.split("|")[1].strip().strip("`") for line in DOC.read_text().splitlines()
            if line.startswith("| `")}
    assert sorted(set(TpserveConfig.model_fields) - rows) == []
