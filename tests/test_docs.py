"""The README's configuration table lists exactly the settings `woq serve` accepts."""
import re
from pathlib import Path

from woq.service.config import ServeSettings

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_config_table_matches_settings():
    text = README.read_text()
    rows = re.findall(r"^\| `--([a-z0-9-]+)` \| `WOQ_([A-Z0-9_]+)` \|", text, flags=re.M)
    flags = {flag for flag, _ in rows}
    assert all(env == flag.upper().replace("-", "_") for flag, env in rows)
    assert flags == {name.replace("_", "-") for name in ServeSettings.model_fields}


def test_readme_metrics_table_matches_exported_metrics():
    from woq.service.metrics import Metrics

    text = README.read_text()
    documented = set(re.findall(r"^\| `(woq_[a-z_]+)` \|", text, flags=re.M))
    exported = set()
    for metric in Metrics().registry.collect():
        exported.add(metric.name + ("_total" if metric.type == "counter" else ""))
    assert documented == exported
