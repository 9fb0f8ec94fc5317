"""docs/distributed_strategy.md stays in step with the declarations, and says only what is
true: its examples switch on only strategies that act, and every setting without effect is
marked."""
import pathlib
import re

from fleetx.strategy import distributed_strategy as ds

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "distributed_strategy.md"


def test_generated_reference_is_current():
    text = DOC.read_text(encoding="utf-8")
    m = re.search(r"<!-- BEGIN GENERATED REFERENCE -->\n(.*)<!-- END GENERATED REFERENCE -->",
                  text, re.S)
    assert m, "markers missing in docs/distributed_strategy.md"
    assert m.group(1) == ds.markdown_reference(), (
        "docs/distributed_strategy.md is stale: regenerate with markdown_reference() (see the doc)")


def test_every_alias_is_documented():
    text = DOC.read_text(encoding="utf-8")
    for old in ds._ALIASES:
        assert f"`strategy.{old}`" in text
    for section, cls in ds.MESSAGES.items():
        for old, new in cls.aliases.items():
            assert f'`{section}["{old}"]` | `{section}["{new}"]`' in text
    for spelling in ds._SPELLINGS:
        assert f"`strategy.{spelling}`" in text


def test_the_opening_example_switches_on_only_settings_with_an_effect():
    text = DOC.read_text(encoding="utf-8")
    example = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    switched = re.findall(r"strategy\.(\w+) = True", example)
    assert switched, "the opening example sets no switch"
    for name in switched:
        assert ds.TopLevelConfig.no_effect_of(name) is None, name


def test_every_setting_without_effect_is_marked():
    reference = ds.markdown_reference()
    for key, spec in ds.TopLevelConfig.specs().items():
        row = next(line for line in reference.splitlines() if line.startswith(f"| `{key}` |"))
        assert ("**no effect**" in row) == bool(spec.no_effect), key
    for section, cls in ds.MESSAGES.items():
        block = reference.split(f"### `{section}`")[1].split("###")[0]
        if cls.no_effect:
            assert f"**No effect in fleetx** ({cls.no_effect})" in block, section
            continue
        for key in cls.specs():
            row = next(line for line in block.splitlines() if line.startswith(f"| `{key}` |"))
            assert ("**no effect**" in row) == bool(cls.no_effect_of(key)), f"{section}.{key}"
