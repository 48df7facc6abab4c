"""Depth: admission refuses manifests nested deeper than 64 levels; readers bound the rest."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from events.manifests import ManifestError, load_documents
from events.nesting import (
    MAX_MANIFEST_DEPTH,
    bounded,
    depth,
    shallow,
    too_deep,
    too_deep_value,
)


def _nested(levels: int) -> Any:
    value: Any = {}
    for _ in range(levels - 1):
        value = {"a": value}
    return value


def _claim(parameters: Any) -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "deep", "namespace": "ops"},
        "spec": {
            "devices": {
                "requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu"}}],
                "config": [{"opaque": {"driver": "gpu.example.com", "parameters": parameters}}],
            }
        },
    }


def test_depth_counts_containers_not_brackets_in_strings() -> None:
    assert depth(b'{"a": "[[[{{{", "b": [[1]], "c": "\\\\\\"[["}') == 3
    assert depth(b"1") == 0 and depth(b"[]") == 1
    assert shallow(b"[[1]]", 2) and not shallow(b"[[1]]", 1)


def test_too_deep_names_the_field_where_it_goes_too_deep() -> None:
    text = json.dumps({"spec": {"x": [_nested(70)]}})
    field = too_deep(text)
    assert field is not None and field.startswith("spec.x[0].a.a.a.a")
    assert too_deep(text, 1000) is None
    assert too_deep_value(json.loads(text)) == field
    assert too_deep(json.dumps(_nested(MAX_MANIFEST_DEPTH))) is None
    assert too_deep(json.dumps(_nested(MAX_MANIFEST_DEPTH + 1))) is not None


def test_a_value_that_refers_to_itself_is_too_deep() -> None:
    loop: list[Any] = []
    loop.append(loop)
    assert too_deep_value({"loop": loop}) is not None


@pytest.mark.parametrize("levels", [60, 2450])
@pytest.mark.parametrize("form", ["json", "yaml"])
def test_admission_refuses_a_manifest_nested_deeper_than_64_levels(levels: int, form: str) -> None:
    if form == "json":
        text = json.dumps(_claim(_nested(levels)))
    else:  # block YAML: a 256 KiB manifest holds a few hundred levels of indentation
        text = yaml.safe_dump(_claim(_nested(min(levels, 200))), default_flow_style=False)
    with pytest.raises(ManifestError) as err:
        load_documents(text, "claims.apply", check=False)
    assert err.value.field.startswith("spec.devices.config[0].opaque.parameters")
    assert err.value.rule == "must not be nested deeper than 64 levels"
    assert "64" in str(err.value)


def test_a_claim_nested_within_the_limit_is_read() -> None:
    [claim] = load_documents(json.dumps(_claim(_nested(50))), "claims.apply", check=False)
    assert claim.metadata.name == "deep"


def test_bounded_keeps_every_value_deeper_than_the_bound_as_its_text() -> None:
    payload = json.dumps({"x": _nested(300), "s": "[[[["}).encode()
    cut = bounded(payload, 128)
    assert depth(cut) == 128
    value: Any = json.loads(cut)["x"]
    levels = 1
    while isinstance(value, dict):
        value, levels = value["a"], levels + 1
    assert isinstance(value, str) and value.encode() in payload
    assert bounded(cut, 128) == cut  # deterministic: nothing left to cut
    small = json.dumps({"x": _nested(100)}).encode()
    assert bounded(small, 128) is small  # unchanged, not copied


def test_an_api_request_nested_too_deep_is_refused_naming_the_field() -> None:
    from services.claims import apicore

    body = b'{"name": "x", "junk": ' + b'{"a": ' * 3000 + b"1" + b"}" * 3000 + b"}"
    with pytest.raises(apicore.InvalidRequestError) as err:
        apicore.decode_request(body, apicore.NameRequest)
    assert "64 levels" in str(err.value.rule) and "junk" in str(err.value.field)
