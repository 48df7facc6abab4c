"""Loading manifests: parsing, decoding by kind, error locations, round trips, examples."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from events import manifests, model
from events.errors import ValidationError
from events.features import FeatureGates
from events.manifests import ManifestError, dump_yaml, load_documents, load_paths

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"

SLICE = """\
apiVersion: resource.k8s.io/v1
kind: ResourceSlice
metadata:
  name: node-a-gpu.dracap.io
spec:
  driver: gpu.dracap.io
  nodeName: node-a
  pool: {name: node-a-gpus, generation: 1, resourceSliceCount: 1}
  devices:
    - name: gpu-0
      allowMultipleAllocations: true
      capacity:
        memory:
          value: 40Gi
          requestPolicy:
            default: 5Gi
            validRange: {min: 5Gi, step: 5Gi}
"""

NAMESPACE = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: tenant-a\n"


@pytest.fixture(scope="module")
def examples() -> list[tuple[str, model.Manifest]]:
    return load_paths([str(EXAMPLES)])


# --- the examples ------------------------------------------------------------------------


def test_examples_load_in_sorted_file_order(examples: list[tuple[str, model.Manifest]]) -> None:
    files = [Path(source).name for source, _ in examples]
    assert files == sorted(files)
    assert set(files) == {
        "claims.yaml",
        "gpu-memory.yaml",
        "namespaces.yaml",
        "vnic-bandwidth.yaml",
    }
    kinds = {type(obj).__name__ for _, obj in examples}
    assert kinds == {"DeviceClass", "ResourceSlice", "ResourceClaim", "Namespace"}


def test_examples_fixed_names(examples: list[tuple[str, model.Manifest]]) -> None:
    classes = {o.metadata.name for _, o in examples if isinstance(o, model.DeviceClass)}
    drivers = {o.spec.driver for _, o in examples if isinstance(o, model.ResourceSlice)}
    namespaces = [o for _, o in examples if isinstance(o, model.Namespace)]
    assert classes == {"gpu-memory.dracap.io", "vnic-bandwidth.dracap.io"}
    assert drivers == {"gpu.dracap.io", "vnic.dracap.io"}
    assert {ns.metadata.name for ns in namespaces if ns.allows_admin_access} == {"ops"}


def test_examples_pass_the_official_schema(examples: list[tuple[str, model.Manifest]]) -> None:
    for _, obj in examples:
        kubernetes_validate.validate(model.to_builtins(obj), "1.34.0", strict=True)


def test_schema_check_is_not_vacuous(examples: list[tuple[str, model.Manifest]]) -> None:
    data = model.to_builtins(examples[0][1])
    data["spec"]["bogus"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(data, "1.34.0", strict=True)


def test_examples_round_trip(examples: list[tuple[str, model.Manifest]]) -> None:
    objs = [obj for _, obj in examples]
    assert load_documents(dump_yaml(objs), "dump.yaml") == objs
    json_text = json.dumps({"kind": "List", "items": [model.to_builtins(o) for o in objs]})
    assert load_documents(json_text, "dump.json") == objs


def test_examples_need_consumable_capacity() -> None:
    with pytest.raises(ManifestError) as info:
        load_paths([str(EXAMPLES / "gpu-memory.yaml")], FeatureGates(consumable_capacity=False))
    assert "allowMultipleAllocations" in info.value.field
    assert "DRAConsumableCapacity" in info.value.rule


# --- document shapes ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "count"),
    [
        pytest.param(f"{NAMESPACE}---\n---\n{SLICE}", 2, id="yaml-multi-with-empty"),
        pytest.param(f"---\n{NAMESPACE}...\n", 1, id="yaml-explicit-markers"),
        pytest.param("", 0, id="empty-text"),
        pytest.param(
            '{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"a"}}', 1, id="json"
        ),
        pytest.param(
            '{"apiVersion":"v1","kind":"NamespaceList","items":'
            '[{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"a"}},'
            '{"apiVersion":"v1","kind":"Namespace","metadata":{"name":"b"}}]}',
            2,
            id="json-typed-list",
        ),
        pytest.param("kind: List\napiVersion: v1\nitems: []\n", 0, id="yaml-empty-list"),
    ],
)
def test_document_shapes(text: str, count: int) -> None:
    assert len(load_documents(text, "x.yaml")) == count


def _as_json(text: str) -> str:
    return json.dumps(yaml.safe_load(text))


def test_json_objects_separated_by_dashes_are_yaml() -> None:
    # valid YAML that kubectl reads; the JSON sniffing must not refuse it
    text = f"{_as_json(NAMESPACE)}\n---\n{_as_json(SLICE)}\n"
    assert text.startswith("{")
    objects = load_documents(text, "docs.json")
    assert [type(o).__name__ for o in objects] == ["Namespace", "ResourceSlice"]
    assert objects == load_documents(f"{NAMESPACE}---\n{SLICE}", "docs.yaml")


@pytest.mark.parametrize(
    ("text", "rule", "where"),
    [
        pytest.param('{"kind": ', "invalid JSON", "line 1 column 10", id="json-cut-short"),
        pytest.param(
            '{"apiVersion": "v1"}\n---\n{"kind": [\n',
            "invalid YAML",
            "line 4 column 1",
            id="second-document-broken",
        ),
    ],
)
def test_the_parser_that_read_further_reports(text: str, rule: str, where: str) -> None:
    with pytest.raises(ManifestError) as info:
        load_documents(text, "x.json")
    assert info.value.field == where and info.value.rule.startswith(rule)


YAML_FEATURES = """\
base: &b {x: 1, y: "two", z: true, t: 2024-01-02, n: null, f: 1.5, q: "40Gi"}
merged:
  <<: *b
  y: three
list: [*b, *b]
1: an int key
---
loop: &r [*r]
"""
SAME_WITHOUT_LIBYAML = """
import sys, yaml
del yaml.CSafeLoader  # as on a platform where PyYAML was built without libyaml
from events import manifests
assert manifests._ManifestLoader.__mro__[1] is yaml.SafeLoader
docs = manifests._parse(sys.stdin.read(), "x.yaml")
print(repr(docs[0]))
"""


@pytest.mark.skipif(not yaml.__with_libyaml__, reason="PyYAML built without libyaml")
def test_libyaml_parses_where_pyyaml_has_it() -> None:
    assert issubclass(manifests._ManifestLoader, yaml.CSafeLoader)


def test_yaml_features_read_as_the_safe_loader_reads_them() -> None:
    expected = list(yaml.safe_load_all(YAML_FEATURES))
    got = manifests._parse(YAML_FEATURES, "x.yaml")
    assert got[0] == expected[0]
    assert got[1]["loop"][0] is got[1]["loop"]  # a recursive alias still loads
    # and the pure-Python fallback reads the same
    done = subprocess.run(
        [sys.executable, "-c", SAME_WITHOUT_LIBYAML],
        input=YAML_FEATURES,
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.stdout.strip() == repr(expected[0])


def _bomb(levels: int) -> str:
    """Anchors that each repeat the previous one ten times ("billion laughs")."""
    lines = ['l0: &l0 ["x","x","x","x","x","x","x","x","x","x"]']
    for i in range(1, levels):
        refs = ",".join([f"*l{i - 1}"] * 10)
        lines.append(f"l{i}: &l{i} [{refs}]")
    return "\n".join(lines) + "\n"


def test_aliases_that_expand_past_the_document_are_refused() -> None:
    with pytest.raises(ManifestError, match="aliases expand the document past 10 times"):
        manifests._parse(_bomb(9), "bomb.yaml")  # 10^9 strings, had it been built


def test_a_few_aliases_are_fine() -> None:
    [doc] = manifests._parse(_bomb(3), "few.yaml")
    assert len(doc["l2"]) == 10 and doc["l2"][0][0] == ["x"] * 10


# --- errors --------------------------------------------------------------------------------

BAD_QUANTITY = SLICE.replace("value: 40Gi", "value: 40GiB")
WRONG_TYPE = SLICE.replace("generation: 1", "generation: one")
MISSING_MIN = SLICE.replace("{min: 5Gi, step: 5Gi}", "{step: 5Gi}")
INVALID = SLICE.replace("generation: 1", "generation: -1")


@pytest.mark.parametrize(
    ("text", "document", "field", "rule"),
    [
        pytest.param("a: [1, 2\n", None, "line 2 column 1", "invalid YAML", id="bad-yaml"),
        pytest.param('{"kind": ', 1, "line 1 column 10", "invalid JSON", id="bad-json"),
        pytest.param(
            f"{NAMESPACE}---\nkind: Pod\napiVersion: v1\n", 2, "kind", "unknown kind", id="kind"
        ),
        pytest.param("apiVersion: v1\nmetadata: {}\n", 1, "kind", "required", id="no-kind"),
        pytest.param("- 1\n", 1, "<root>", "must be an object", id="not-an-object"),
        pytest.param(
            SLICE.replace("resource.k8s.io/v1", "resource.k8s.io/v1beta2"),
            1,
            "apiVersion",
            "must be resource.k8s.io/v1",
            id="api-version",
        ),
        pytest.param(
            NAMESPACE.replace("v1", "resource.k8s.io/v1"),
            1,
            "apiVersion",
            "must be v1",
            id="ns-api",
        ),
        pytest.param(
            BAD_QUANTITY,
            1,
            "spec.devices[0].capacity[memory].value",
            "quantity '40GiB'",
            id="bad-quantity",
        ),
        pytest.param(
            WRONG_TYPE, 1, "spec.pool.generation", "Expected `int`, got `str`", id="wrong-type"
        ),
        pytest.param(
            MISSING_MIN,
            1,
            "spec.devices[0].capacity[memory].requestPolicy.validRange.min",
            "required",
            id="missing-field",
        ),
        pytest.param(
            f"{NAMESPACE}---\n{INVALID}",
            2,
            "spec.pool.generation",
            "greater than or equal to 0",
            id="validation",
        ),
    ],
)
def test_errors_name_file_document_and_field(
    text: str, document: int | None, field: str, rule: str
) -> None:
    with pytest.raises(ManifestError) as info:
        load_documents(text, "bad.yaml")
    error = info.value
    assert isinstance(error, ValidationError)
    assert error.source == "bad.yaml"
    assert error.document == document
    assert error.field == field
    assert rule in error.rule
    assert str(error).startswith("bad.yaml")
    assert field in str(error)


def test_error_names_the_object() -> None:
    with pytest.raises(ManifestError) as info:
        load_documents(INVALID, "slice.yaml")
    assert info.value.object == "ResourceSlice node-a-gpu.dracap.io"
    assert "slice.yaml document 1 (ResourceSlice node-a-gpu.dracap.io)" in str(info.value)


def test_error_names_the_list_item() -> None:
    items = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": n}} for n in "a_"]
    with pytest.raises(ManifestError) as info:
        load_documents(json.dumps({"kind": "List", "items": items}), "l.json")
    assert (info.value.document, info.value.item, info.value.field) == (1, 1, "metadata.name")


def test_map_key_is_found_among_several() -> None:
    two = SLICE.replace(
        "      capacity:\n", "      capacity:\n        other: {value: 1}\n"
    ).replace("value: 40Gi", "value: 4x")
    with pytest.raises(ManifestError) as info:
        load_documents(two, "two.yaml")
    assert info.value.field == "spec.devices[0].capacity[memory].value"


def test_ambiguous_map_key_stays_unresolved() -> None:
    text = SLICE.replace("      capacity:\n", "      capacity:\n        other: {value: 1}\n")
    text = text.replace("      allowMultipleAllocations: true\n", "").replace(
        "memory:\n          value: 40Gi\n", "memory:\n          value: [1]\n"
    )
    with pytest.raises(ManifestError) as info:
        load_documents(text, "amb.yaml")
    assert info.value.field == "spec.devices[0].capacity[...].value"


# --- files and directories -------------------------------------------------------------------


def test_load_paths_walks_directories_sorted(tmp_path: Path) -> None:
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "2.yml").write_text(NAMESPACE.replace("tenant-a", "two"))
    (tmp_path / "b" / "1.json").write_text(
        json.dumps({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "one"}})
    )
    (tmp_path / "a.yaml").write_text(NAMESPACE.replace("tenant-a", "zero"))
    (tmp_path / "notes.txt").write_text("not a manifest")
    loaded = load_paths([str(tmp_path)])
    assert [obj.metadata.name for _, obj in loaded] == ["zero", "one", "two"]
    assert loaded[1][0] == str(tmp_path / "b" / "1.json")


def test_load_paths_explicit_file_and_missing_file(tmp_path: Path) -> None:
    named = tmp_path / "ns.txt"
    named.write_text(NAMESPACE)
    assert len(load_paths([str(named)])) == 1
    with pytest.raises(ManifestError) as info:
        load_paths([str(tmp_path / "missing.yaml")])
    assert info.value.source.endswith("missing.yaml")
    assert "cannot read" in info.value.rule


def test_dump_yaml_is_multi_document_with_canonical_quantities() -> None:
    objs = load_documents(SLICE.replace("40Gi", "40960Mi") + "---\n" + NAMESPACE, "x.yaml")
    text = dump_yaml(objs)
    assert text.count("\n---\n") == 1
    assert "value: 40Gi" in text
    assert text.startswith("apiVersion: resource.k8s.io/v1\nkind: ResourceSlice\n")
