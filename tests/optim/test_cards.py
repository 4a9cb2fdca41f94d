"""The recipe docs match the recipe configs: one card per config name, and every removed recipe recorded."""

from __future__ import annotations

import re

from conftest import RECIPE_DIR, REPO, stack_of

REMOVED = ("pad_conv_channels", "cuda_graphs", "compile_max_autotune")


def test_every_recipe_has_one_card_and_a_table_row() -> None:
    cards = (REPO / "optim" / "CARDS.md").read_text()
    guide = (REPO / "docs" / "recipes.md").read_text()
    named = [name for heading in re.findall(r"^## (.+?) \(", cards, flags=re.M) for name in heading.split(", ")]
    configs = sorted(p.stem for p in RECIPE_DIR.glob("*.yaml"))
    assert sorted(named) == configs
    assert sorted(re.findall(r"^\| `(\w+)` \|", guide.split("## Removed recipes")[0], flags=re.M)) == configs
    for name in configs:
        assert stack_of([name]).names == [name]


def test_cards_carry_no_history_and_stay_short() -> None:
    cards = (REPO / "optim" / "CARDS.md").read_text()
    assert not re.search(r"\bround \d+", cards, flags=re.I)
    for card in cards.split("\n## ")[1:]:
        assert len(card.splitlines()) <= 30, card.splitlines()[0]


def test_removed_recipes_are_gone_and_recorded() -> None:
    removed = (REPO / "docs" / "recipes.md").read_text().split("## Removed recipes")[1]
    for name in REMOVED:
        assert not (RECIPE_DIR / f"{name}.yaml").exists()
        assert f"`{name}`" in removed
    assert "forms=[im2col" in removed
