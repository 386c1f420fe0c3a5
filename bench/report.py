"""Turning raw benchmark runs into figures: statistics, ShardVault's time split, Markdown.

Terms:

* *run*: one timed execution of one tool (a dict with at least ``seconds``).
* *phase* of a ShardVault backup, from the execution history's state timestamps:
  ``checkpoint`` (start to the end of the Checkpoint map: Validate, Flush where several
  nodes flush first, Checkpoint),
  ``plan`` (PlanData), ``upload`` (the data Upload map), ``tail`` (from the data Upload map's
  end to Release: CheckUploads, Stop, PlanTail, the tail Upload map), ``finalize`` (Release
  and Finalize, to the execution's success).
* *agent commands*: the agent logs ``<command>:<backup id>[:<key>] done in <s> s`` when a
  command is answered; from those, the time the agent was busy packing (reading the source
  once into zstd frames, CRC64NVME of the stored bytes, into a packed copy) and uploading.
* *object steps*: one data object's way through the Upload map, from the agent's log and the
  control-plane probes (``probes.py``): ``wait_pack`` (inbox to the agent starting to pack:
  poll interval, and a free command slot among ``max_parallel_commands``), ``pack`` (read the
  source, compress, checksum), ``to_sign`` (the answer through Step Functions to Sign),
  ``sign``, ``to_upload`` (Sign to the upload command in the inbox), ``wait_upload``,
  ``upload`` (the parts, ``upload_parallelism`` at once), ``to_complete`` and ``complete``
  (complete and verify by GetObjectAttributes).
* *bytes read* (a run's ``bytes``): what a backup read from the database (a restore: what it
  wrote); *stored bytes* (``stored_bytes``): what a backup left in its bucket, from a listing
  (``backup_vs_peers.py`` says which keys); ``None`` for restores.
* *targets* (``TARGETS``): ratios of ShardVault to pgBackRest, each with its limit, given of
  the medians and per round (min / median / max); *held* says whether every round, or only
  the medians, stayed within the limit.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime
from typing import Any

MiB = 1024 * 1024
RESTORE_TOOLS = {"shardvault-restore", "pgbackrest-restore"}
OBJECT_TARGET_SIZE = 256 * MiB
PHASES = ("checkpoint", "plan", "upload", "tail", "finalize")
OBJECT_STEPS = (
    "wait_pack",
    "pack",
    "to_sign",
    "sign",
    "to_upload",
    "wait_upload",
    "upload",
    "to_complete",
    "complete",
)


@dataclass(frozen=True)
class Target:
    """``tool``'s ``key`` ÷ ``peer``'s must be at most ``limit``."""

    name: str
    tool: str
    peer: str
    key: str
    limit: float


TARGETS = (
    Target("ShardVault full backup wall time ÷ pgBackRest's (zst)", "shardvault", "pgbackrest",
           "seconds", 0.8),
    Target("ShardVault stored bytes ÷ pgBackRest's stored bytes", "shardvault", "pgbackrest",
           "stored_bytes", 1.1),
    Target("ShardVault restore ÷ pgBackRest restore (+ start + pg_amcheck)",
           "shardvault-restore", "pgbackrest-restore", "seconds", 1.0),
)  # fmt: skip
LOG_LINE = re.compile(
    r"^(?P<at>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) \S+ INFO "
    r"(?P<command>\w+):(?P<backup>[^:\s]+)(?::(?P<key>\S+))? done in (?P<seconds>[\d.]+) s$"
)


# --- statistics ---------------------------------------------------------------------------------
def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def object_target(total_bytes: int, shards: int = 1) -> int:
    """The objects a backup of ``total_bytes`` should need at most: one per 256 MiB, plus one
    per shard."""
    return math.ceil(total_bytes / OBJECT_TARGET_SIZE) + shards


def pair_ratios(
    runs: list[dict[str, Any]], others: list[dict[str, Any]], key: str = "seconds"
) -> dict[str, float] | None:
    """Spread of ``run[key] / other[key]`` over the rounds both ran (pairs by ``round``)."""
    by_round = {other["round"]: other[key] for other in others}
    values = [run[key] / by_round[run["round"]] for run in runs if run["round"] in by_round]
    return spread(values) if values else None


def target_results(
    runs: dict[str, list[dict[str, Any]]], targets: tuple[Target, ...] = TARGETS
) -> list[dict[str, Any]]:
    """Each target whose two tools ran: its ratio of the medians, per round, and whether it
    held."""
    out = []
    for target in targets:
        mine, theirs = runs.get(target.tool), runs.get(target.peer)
        if not (mine and theirs):
            continue
        of_medians = median_of(mine, target.key) / median_of(theirs, target.key)
        per_round = pair_ratios(mine, theirs, target.key)
        if per_round and per_round["max"] <= target.limit:
            held = "yes, every round"
        elif of_medians <= target.limit:
            held = "on the medians, not every round"
        else:
            held = "no"
        out.append(
            {
                "target": target.name,
                "limit": target.limit,
                "of_medians": of_medians,
                "per_round": per_round,
                "held": held,
            }
        )
    return out


# --- ShardVault's execution history -------------------------------------------------------------
def state_spans(
    events: list[dict[str, Any]], names: set[str]
) -> tuple[list[tuple[str, float, float]], float]:
    """(state, entered, exited) for the top-level ``names``, in seconds from the execution's
    start, and the time the execution ended."""
    start: datetime = events[0]["timestamp"]
    entered: dict[str, float] = {}
    spans: list[tuple[str, float, float]] = []
    end = 0.0
    for event in events:
        at = (event["timestamp"] - start).total_seconds()
        end = max(end, at)
        if (details := event.get("stateEnteredEventDetails")) and details["name"] in names:
            entered[details["name"]] = at
        elif (details := event.get("stateExitedEventDetails")) and details["name"] in entered:
            spans.append((details["name"], entered.pop(details["name"]), at))
    return spans, end


def _nth(spans: list[tuple[str, float, float]], name: str, n: int) -> tuple[float, float] | None:
    found = [(entered, exited) for state, entered, exited in spans if state == name]
    return found[n] if len(found) > n else None


def phase_split(spans: list[tuple[str, float, float]], end: float) -> dict[str, float]:
    """Seconds per phase (see the module docstring); they add up to the execution's time."""
    checkpoint = _nth(spans, "Checkpoint", 0)
    data_upload = _nth(spans, "Upload", 0)
    release = _nth(spans, "Release", 0)
    if not (checkpoint and data_upload and release):
        raise ValueError(f"unexpected execution history: {[s[0] for s in spans]}")
    return {
        "checkpoint": checkpoint[1],
        "plan": data_upload[0] - checkpoint[1],
        "upload": data_upload[1] - data_upload[0],
        "tail": release[0] - data_upload[1],
        "finalize": end - release[0],
    }


def state_seconds(spans: list[tuple[str, float, float]]) -> dict[str, float]:
    """Seconds per top-level state; a state entered twice is ``Name#2`` the second time."""
    out: dict[str, float] = {}
    for name, entered, exited in spans:
        label, n = name, 1
        while label in out:
            n += 1
            label = f"{name}#{n}"
        out[label] = round(exited - entered, 3)
    return out


# --- the agent's log ----------------------------------------------------------------------------
def agent_commands(log_text: str, backup_id: str) -> list[dict[str, Any]]:
    """The agent's finished commands of ``backup_id``: command, key, start and end (epoch
    seconds; the log's local time is this machine's, like the probes' clock)."""
    out = []
    for line in log_text.splitlines():
        match = LOG_LINE.match(line)
        if not match or match["backup"] != backup_id:
            continue
        at = datetime.strptime(match["at"], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        seconds = float(match["seconds"])
        out.append(
            {"command": match["command"], "key": match["key"], "start": at - seconds, "end": at}
        )
    return out


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of ``intervals``: time during which at least one was running."""
    total, current_start, current_end = 0.0, None, None
    for start, end in sorted(intervals):
        if current_end is None or start > current_end:
            if current_end is not None:
                total += current_end - current_start
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        total += current_end - current_start
    return total


def agent_split(commands: list[dict[str, Any]]) -> dict[str, float]:
    """For the data objects: agent time checksumming and uploading, summed over objects and
    as wall time during which at least one object was at that step."""
    data = [c for c in commands if c["key"] and "/data-" in c["key"]]
    by_command: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for command in data:
        by_command[command["command"]].append((command["start"], command["end"]))
    return {
        "objects": len({c["key"] for c in data}),
        "pack_sum": sum(end - start for start, end in by_command["pack"]),
        "pack_wall": busy_seconds(by_command["pack"]),
        "upload_sum": sum(end - start for start, end in by_command["upload"]),
        "upload_wall": busy_seconds(by_command["upload"]),
        "agent_busy_wall": busy_seconds(by_command["pack"] + by_command["upload"]),
    }


def _latest(events: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """The last event per (command, key): a retried step counts by its last try."""
    return {(e["command"], e["key"]): e for e in sorted(events, key=lambda e: e["start"])}


def object_steps(
    commands: list[dict[str, Any]], probes: list[dict[str, Any]]
) -> list[dict[str, float]]:
    """Seconds per step (see the module docstring) of each data object, in plan order."""
    agent = _latest(commands)
    dispatched = _latest([p for p in probes if p["step"] == "dispatch"])
    control = _latest([p for p in probes if p["step"] != "dispatch"])
    out = []
    for key in sorted({c["key"] for c in commands if c["key"] and "/data-" in c["key"]}):
        try:
            pk, up = agent[("pack", key)], agent[("upload", key)]
            d_pk, d_up = dispatched[("pack", key)], dispatched[("upload", key)]
            sign, complete = control[("sign", key)], control[("complete", key)]
        except KeyError:
            continue  # a step without a record (a failed try): no timeline for this object
        out.append(
            {
                "object": key.rsplit("/", 1)[-1],
                "dispatched_at": d_pk["end"],
                "wait_pack": pk["start"] - d_pk["end"],
                "pack": pk["end"] - pk["start"],
                "to_sign": sign["start"] - pk["end"],
                "sign": sign["end"] - sign["start"],
                "to_upload": d_up["end"] - sign["end"],
                "wait_upload": up["start"] - d_up["end"],
                "upload": up["end"] - up["start"],
                "to_complete": complete["start"] - up["end"],
                "complete": complete["end"] - complete["start"],
            }
        )
    first = min((o["dispatched_at"] for o in out), default=0.0)
    for item in out:
        item["dispatched_at"] -= first
    return out


# --- summary and Markdown -----------------------------------------------------------------------
def summarize(runs: dict[str, list[dict[str, Any]]], labels: dict[str, str]) -> dict[str, Any]:
    """Per tool: spread of wall times, median bytes/objects/CPU; ratios from the medians."""
    tools = {}
    for tool, tool_runs in runs.items():
        if not tool_runs:
            continue
        seconds = [run["seconds"] for run in tool_runs]
        stored = [run.get("stored_bytes") for run in tool_runs]
        tools[tool] = {
            "label": labels[tool],
            "seconds": spread(seconds),
            "bytes": median_of(tool_runs, "bytes"),
            "stored_bytes": None if None in stored else statistics.median(stored),
            "objects": None
            if any(run["objects"] is None for run in tool_runs)
            else median_of(tool_runs, "objects"),
            "mib_per_s": median_of(tool_runs, "bytes") / statistics.median(seconds) / MiB,
            "client_cpu_seconds": median_of(tool_runs, "client_cpu_seconds"),
            "minio_cpu_seconds": median_of(tool_runs, "minio_cpu_seconds"),
            "load_before": spread([run["load_before"] for run in tool_runs]),
        }
    shardvault = tools.get("shardvault")
    summary: dict[str, Any] = {"tools": tools, "targets": target_results(runs)}
    if shardvault:
        reference = shardvault["seconds"]["median"]
        summary["ratios"] = {
            f"shardvault/{tool}": reference / info["seconds"]["median"]
            for tool, info in tools.items()
            if tool not in RESTORE_TOOLS | {"shardvault"}
        }
        summary["pair_ratios"] = {
            f"shardvault/{tool}": pair_ratios(runs["shardvault"], runs[tool])
            for tool in tools
            if tool not in RESTORE_TOOLS | {"shardvault"}
        }
        if restore := tools.get("shardvault-restore"):
            own = restore["seconds"]["median"]
            summary["restore_ratios"] = {"shardvault-restore/shardvault": own / reference}
            summary["pair_ratios"]["shardvault-restore/shardvault"] = pair_ratios(
                runs["shardvault-restore"], runs["shardvault"]
            )
            if peer := tools.get("pgbackrest-restore"):
                summary["restore_ratios"]["shardvault-restore/pgbackrest-restore"] = (
                    own / peer["seconds"]["median"]
                )
                summary["pair_ratios"]["shardvault-restore/pgbackrest-restore"] = pair_ratios(
                    runs["shardvault-restore"], runs["pgbackrest-restore"]
                )
            summary["restore_agent_peak_rss_mib"] = (
                max(run["agent_peak_rss"] for run in runs["shardvault-restore"]) / MiB
            )
        sv_runs = runs["shardvault"]
        summary["shardvault"] = {
            "object_target": object_target(
                int(shardvault["bytes"]), max(run.get("shards", 1) for run in sv_runs)
            ),
            "objects": [run["objects"] for run in sv_runs],
            "parts": [run["parts"] for run in sv_runs],
            "part_size": sv_runs[0]["part_size"],
            "agent_peak_rss_mib": max(run["agent_peak_rss"] for run in sv_runs) / MiB,
            "phases": {p: statistics.median(r["phases"][p] for r in sv_runs) for p in PHASES},
            "agent": {
                key: statistics.median(r["agent"][key] for r in sv_runs)
                for key in sv_runs[0]["agent"]
            },
            "execution_seconds": median_of(sv_runs, "execution_seconds"),
            "agent_cpu_seconds": median_of(sv_runs, "agent_cpu_seconds"),
            "control_plane_cpu_seconds": median_of(sv_runs, "control_plane_cpu_seconds"),
            "data_bytes": median_of(sv_runs, "data_bytes"),
            "stored": {
                key: median_of(sv_runs, key)
                for key in (
                    "stored_object_bytes",
                    "stored_manifest_bytes",
                    "manifest_stored_bytes",
                    "catalog_stored_bytes",
                )
            },
            "compression_levels": sorted({run["compression_level"] for run in sv_runs}, key=str),
            "encrypted": any(run["encrypted"] for run in sv_runs),
            "tail_bytes": median_of(sv_runs, "tail_bytes"),
            "object_steps": {
                step: statistics.median(o[step] for r in sv_runs for o in r["objects_steps"])
                for step in OBJECT_STEPS
            },
        }
    return summary


def _s(value: float) -> str:
    return f"{value:.1f}"


def nested(run: dict[str, Any], key: str) -> Any:
    """``run[key]``, where ``key`` may name a nested figure as ``outer.inner``."""
    value: Any = run
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def spread_of(runs: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    """``spread`` of a (nested) figure over the runs; None when a run lacks it."""
    values = [nested(run, key) for run in runs]
    return None if not values or None in values else spread(values)


def spread_cell(values: dict[str, float] | None, digits: int = 1, scale: float = 1.0) -> str:
    """``min / median / max`` of a ``spread`` (in units of ``scale``); "—" when none."""
    if not values:
        return "—"
    return " / ".join(f"{values[k] / scale:,.{digits}f}" for k in ("min", "median", "max"))


def median_cell(values: dict[str, float] | None, digits: int = 1, scale: float = 1.0) -> str:
    """The median of a ``spread`` (in units of ``scale``); "—" when none."""
    return "—" if not values else f"{values['median'] / scale:,.{digits}f}"


def spread_text(values: dict[str, float] | None, digits: int = 2) -> str:
    """min / median / max of a figure's rounds."""
    if not values:
        return "—"
    return " / ".join(f"{values[k]:.{digits}f}" for k in ("min", "median", "max"))


def limit_text(limit: float) -> str:
    """A target's limit: one decimal (0.8, 1.0), two below 0.1 (0.03)."""
    return f"{limit:.1f}" if limit >= 0.1 else f"{limit:.2f}"


def _mib(value: float) -> str:
    return f"{value / MiB:,.0f}"


def _mib1(value: float | None) -> str:
    return "—" if value is None else f"{value / MiB:,.1f}"


def tools_table(summary: dict[str, Any]) -> str:
    ratios = summary.get("ratios", {})
    pairs = summary.get("pair_ratios", {})
    target = summary.get("shardvault", {}).get("object_target")
    rows = [
        "| tool | wall s min / median / max | MiB/s (median, of MiB read) | MiB read (restores: "
        f"written) | MiB stored | objects (target {target}) | client CPU s | MinIO CPU s "
        "| load avg before | ShardVault ÷ tool (medians) | ShardVault ÷ tool per round "
        "(min / median / max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tool, info in summary["tools"].items():
        spread_s = " / ".join(_s(info["seconds"][k]) for k in ("min", "median", "max"))
        ratio = ratios.get(f"shardvault/{tool}")
        pair = pairs.get(f"shardvault/{tool}")
        objects = "—" if info["objects"] is None else f"{info['objects']:.0f}"
        rows.append(
            f"| {info['label']} | {spread_s} | {info['mib_per_s']:.0f} | {_mib(info['bytes'])} | "
            f"{_mib1(info['stored_bytes'])} | {objects} | {_s(info['client_cpu_seconds'])} | "
            f"{_s(info['minio_cpu_seconds'])} | {_s(info['load_before']['min'])} to "
            f"{_s(info['load_before']['max'])} | {f'{ratio:.2f}' if ratio else '—'} | "
            f"{spread_text(pair)} |"
        )
    return "\n".join(rows)


def shardvault_table(summary: dict[str, Any]) -> str:
    sv = summary["shardvault"]
    phases, agent, stored = sv["phases"], sv["agent"], sv["stored"]
    rows = [
        "| ShardVault (medians) | value |",
        "| --- | --- |",
        f"| objects per backup (target ceil(bytes / 256 MiB) + 1 per shard = "
        f"{sv['object_target']}) | "
        f"{', '.join(map(str, sv['objects']))} |",
        f"| parts per backup; part size | {', '.join(map(str, sv['parts']))}; "
        f"{sv['part_size'] // MiB} MiB |",
        f"| MiB in the data stream + tail stream (WAL, backup label) | {_mib(sv['data_bytes'])} + "
        f"{_mib(sv['tail_bytes'])} |",
        f"| compression; encrypted | zstd level {', '.join(map(str, sv['compression_levels']))}; "
        f"{'yes' if sv['encrypted'] else 'no'} |",
        f"| MiB stored: objects + manifest, listed (manifest's stored_bytes; catalog's) | "
        f"{_mib1(stored['stored_object_bytes'])} + {_mib1(stored['stored_manifest_bytes'])} "
        f"({_mib1(stored['manifest_stored_bytes'])}; {_mib1(stored['catalog_stored_bytes'])}) |",
        f"| CPU s: agent; control plane (moto, Lambda handlers) | {_s(sv['agent_cpu_seconds'])}; "
        f"{_s(sv['control_plane_cpu_seconds'])} |",
        f"| agent peak RSS (VmHWM, all runs) | {sv['agent_peak_rss_mib']:.0f} MiB |",
        *(
            [f"| restore agent peak RSS (VmHWM, all runs) | {restore_rss:.0f} MiB |"]
            if (restore_rss := summary.get("restore_agent_peak_rss_mib"))
            else []
        ),
        f"| execution start → stop (Step Functions) | {_s(sv['execution_seconds'])} s |",
    ]
    rows += [f"| phase: {name} | {_s(phases[name])} s |" for name in PHASES]
    rows += [
        f"| agent: pack (read, zstd, CRC64NVME), wall (sum over objects) | "
        f"{_s(agent['pack_wall'])} s ({_s(agent['pack_sum'])} s) |",
        f"| agent: upload, wall (sum over objects) | {_s(agent['upload_wall'])} s "
        f"({_s(agent['upload_sum'])} s) |",
        f"| agent busy with any data object, wall | {_s(agent['agent_busy_wall'])} s |",
    ]
    steps = sv["object_steps"]
    rows += [f"| per data object, median: {name} | {steps[name]:.2f} s |" for name in OBJECT_STEPS]
    return "\n".join(rows)


def ratios_text(summary: dict[str, Any]) -> str:
    tools, pairs = summary["tools"], summary.get("pair_ratios", {})

    def per_round(key: str) -> str:
        return f" (per round: {spread_text(pairs[key])})" if pairs.get(key) else ""

    lines = [
        f"- ShardVault ÷ {tools[key.split('/', 1)[1]]['label']}: {value:.2f}{per_round(key)}"
        for key, value in summary.get("ratios", {}).items()
    ]
    lines += [
        f"- {tools[a]['label']} ÷ {tools[b]['label']}: {value:.2f}{per_round(key)}"
        for key, value in summary.get("restore_ratios", {}).items()
        for a, b in [key.split("/", 1)]
    ]
    return "\n".join(lines)


def target_rows(summary: dict[str, Any], digits: int = 2) -> list[str]:
    """The targets table's header and a row per target, ratios to ``digits`` places."""
    return [
        "| target | of the medians | per round (min / median / max) | limit | held |",
        "| --- | --- | --- | --- | --- |",
    ] + [
        f"| {t['target']} | {t['of_medians']:.{digits}f} | "
        f"{spread_text(t['per_round'], digits)} | ≤ {limit_text(t['limit'])} | {t['held']} |"
        for t in summary.get("targets", [])
    ]


def targets_table(summary: dict[str, Any]) -> str:
    return "\n".join(target_rows(summary))


def markdown(summary: dict[str, Any]) -> str:
    parts = [tools_table(summary)]
    if summary.get("targets"):
        parts += ["Targets:\n\n" + targets_table(summary)]
    if "shardvault" in summary:
        parts += [
            "Ratios (of the medians; in brackets, min / median / max of the per-round ratios):"
            "\n\n" + ratios_text(summary)
        ]
        parts += [shardvault_table(summary)]
    return "\n\n".join(parts) + "\n"
