"""gateway/workers/catalog.py: models by name and alias, entries added at run time."""

from __future__ import annotations

import pytest

from gateway.errors import GatewayError
from gateway.workers.catalog import Catalog
from shared.config import ModelConfig
from shared.types import ErrorCode


def _catalog() -> Catalog:
    return Catalog(
        [
            ModelConfig(name="a", source="/a", aliases=["alpha"]),
            ModelConfig(name="b", source="/b", on_demand="refuse"),
        ]
    )


def test_a_model_is_found_by_name_and_by_alias() -> None:
    catalog = _catalog()
    assert catalog.slot("a") is catalog.slot("alpha")
    assert catalog.get("nope") is None
    assert list(catalog.models) == ["a", "b"]


def test_an_unknown_model_is_a_404_naming_the_available_ones() -> None:
    with pytest.raises(GatewayError) as err:
        _catalog().slot("gpt-4")
    assert err.value.code == ErrorCode.MODEL_NOT_FOUND
    assert err.value.param == "model"
    assert "Available models: a, b." in err.value.message


@pytest.mark.parametrize(
    ("name", "aliases", "taken"),
    [("a", [], "'a'"), ("alpha", [], "'alpha'"), ("c", ["b"], "alias 'b'"), ("d", ["d"], "'d'")],
)
def test_a_new_entry_takes_no_name_or_alias_in_use(
    name: str, aliases: list[str], taken: str
) -> None:
    catalog = _catalog()
    with pytest.raises(GatewayError, match=taken):
        catalog.add(ModelConfig(name=name, source="/x", aliases=aliases))
    assert name not in catalog.slots or name == "a"


def test_a_new_entry_is_found_by_its_aliases() -> None:
    catalog = _catalog()
    slot = catalog.add(ModelConfig(name="c", source="/c", aliases=["gamma"]))
    assert catalog.slot("gamma") is slot


def test_a_request_waits_for_a_load_unless_the_model_refuses_to_load_on_demand() -> None:
    catalog = _catalog()
    assert catalog.must_load("a")
    assert not catalog.must_load("b")  # on_demand = refuse: a 503 at once, no wait
