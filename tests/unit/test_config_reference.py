"""docs/config-reference.md is generated from the config dataclasses and must stay equal to them."""

import dataclasses
import importlib.util
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]


def generator():
    spec = importlib.util.spec_from_file_location("config_reference", ROOT / "tools" / "config_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_equals_what_the_code_generates():
    page = (ROOT / "docs" / "config-reference.md").read_text()
    assert page == generator().render(), (
        "docs/config-reference.md differs from saferun/config.py: run python tools/config_reference.py")


def test_every_key_of_every_section_has_a_row_with_its_default():
    page = generator().render()
    for prefix, cls in generator().SECTIONS:
        for f in dataclasses.fields(cls):
            key = f"{prefix}.{f.name}" if prefix else f.name
            if key in ("trainer", "guards", "trainer.ema", "trainer.fsdp", "trainer.parallel", "sweep"):
                continue  # sections of their own
            assert f"| `{key}` |" in page, key
    assert "| `trainer.precision` | `str` | `fp32` | fp32, bf16, fp16 |" in page


def test_a_field_without_a_docstring_stops_the_generator():
    @dataclasses.dataclass
    class Undocumented:
        documented: int = 1
        """Has one."""

        bare: int = 2

    with pytest.raises(SystemExit, match="Undocumented.bare has no docstring"):
        generator().rows("x", Undocumented)
