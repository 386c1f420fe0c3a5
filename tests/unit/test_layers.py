"""A synthesized full is read as the layers of the chain it copied, then its own changes
(``shardvault.data.chains``); a read full is one layer, an incremental adds one."""

from __future__ import annotations

from shardvault.contracts.models import (
    FileEntry,
    Layer,
    Manifest,
    ManifestShard,
    ManifestStream,
    ObjectResult,
    Phase,
)
from shardvault.data.chains import chain_args, chain_layers, is_layered

FILES = [FileEntry(path="base/1/1234", size=4 << 20)]


def obj(key: str, layer: int | None = None) -> ObjectResult:
    return ObjectResult(
        key=key,
        node_id="n1",
        shard_id="s1",
        phase=Phase.DATA,
        index=0,
        stream_offset=0,
        length=1 << 20,
        part_size=1 << 20,
        part_count=1,
        crc64nvme="AAAAAAAAAAA=",
        verified_by="attributes",
        layer=layer,
    )


def manifest(backup_id: str, objects: list[ObjectResult], **fields: object) -> Manifest:
    data = ManifestStream(
        phase=Phase.DATA,
        files=FILES,
        objects=objects,
        extents=str(fields.pop("extents", "")),
        layers=fields.pop("layers", []),  # type: ignore[arg-type]
    )
    shard = ManifestShard(shard_id="s1", node_id="n1", marker={}, checkpoint_at=0.0, streams=[data])
    return Manifest.model_validate(
        {
            "backup_id": backup_id,
            "cluster": "orders",
            "engine": "postgres",
            "started_at": 0.0,
            "completed_at": 1.0,
            "checkpoint_skew_seconds": 0.0,
            "part_size": 1 << 20,
            "shards": [shard],
            "bytes": 0,
            "objects": len(objects),
            "parts": len(objects),
            "verification": "",
        }
        | fields
    )


SYNTHESIZED = manifest(
    "s",
    [obj("s/base-000-00000", 0), obj("s/base-001-00000", 1), obj("s/data-00000")],
    extents="AgI=",
    synthesized_from="i",
    layers=[
        Layer(backup_id="f", files=FILES, extents=None),
        Layer(backup_id="i", files=FILES, extents="AQE="),
    ],
)


def test_a_synthesized_full_is_its_chains_layers_then_its_changes():
    layers = chain_layers([SYNTHESIZED], "s1")

    assert [(x.backup_id, x.extents) for x in layers] == [("f", None), ("i", "AQE="), ("s", "AgI=")]
    assert [[o.key for o in x.objects] for x in layers] == [
        ["s/base-000-00000"],
        ["s/base-001-00000"],
        ["s/data-00000"],
    ]
    assert is_layered(SYNTHESIZED)


def test_a_read_full_is_one_whole_layer_and_an_incremental_adds_its_changes():
    full = manifest("f", [obj("f/data-00000")])
    incremental = manifest("i", [obj("i/data-00000")], kind="incremental", extents="")

    members = chain_args([full, incremental], "s1")

    assert [(m["backup_id"], m["extents"]) for m in members] == [("f", None), ("i", "")]
    assert not is_layered(full)
    assert is_layered(incremental)


def test_an_incremental_on_a_synthesized_full_continues_its_layers():
    incremental = manifest("j", [obj("j/data-00000")], kind="incremental", extents="AQE=")

    members = chain_args([SYNTHESIZED, incremental], "s1")

    assert [m["backup_id"] for m in members] == ["f", "i", "s", "j"]
    assert members[0]["extents"] is None
