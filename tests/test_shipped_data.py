"""The texts the README's commands default to ship with the package: `woq eval ppl` and
`woq quantize --method gptq` work on a fresh clone, with no ../shared beside it."""
import tomllib
from pathlib import Path

from woq.models.evaluate import DEFAULT_TEXT
from woq.models.quantize import DEFAULT_CALIBRATION

ROOT = Path(__file__).resolve().parents[1]


def test_default_texts_are_inside_the_package_and_declared_as_its_data():
    package = ROOT / "models" / "data"
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["woq.models.data"]
    for path in (DEFAULT_TEXT, DEFAULT_CALIBRATION):
        path = path.resolve()
        assert path.is_relative_to(package), path
        assert any(path.match(str(package / pattern)) for pattern in data), (path, data)
        lines = path.read_text().splitlines()
        assert len(lines) > 3000 and sum(len(line.split()) for line in lines) > 200_000  # whole splits
    assert (DEFAULT_TEXT.parent / "README.md").read_text().count("CC BY-SA 3.0") == 1
