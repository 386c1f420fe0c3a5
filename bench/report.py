"""Turning raw benchmark runs into figures: statistics, ShardVault's time split, Markdown.

Terms:

* *run*: one timed execution of one tool (a dict with at least ``seconds``).
* *phase* of a ShardVault backup, from the execution history's state timestamps:
  ``checkpoint`` (start to the end of the Checkpoint map: Validate, Flush, Checkpoint),
  ``plan`` (PlanData), ``upload`` (the data Upload map), ``tail`` (from the data Upload map's
  end to Release: CheckUploads, Stop, PlanTail, the tail Upload map), ``finalize`` (Release
  and Finalize, to the execution's success).
* *agent commands*: the agent logs ``<command>:<backup id>[:<key>] done in <s> s`` when a
  command is answered; from those, the time the agent was busy checksumming (reading the
  source once; nothing is copied unless a part changed under it) and uploading.
* *object steps*: one data object's way through the Upload map, from the agent's log and the
  control-plane probes (``probes.py``): ``wait_checksum`` (inbox to the agent starting the
  checksum: poll interval, and a free command slot among ``max_parallel_commands``),
  ``checksum`` (read the source, CRC64NVME), ``to_sign`` (the answer through Step Functions
  to Sign), ``sign``, ``to_upload`` (Sign to the upload command in the inbox),
  ``wait_upload``, ``upload`` (the parts, ``upload_parallelism`` at once), ``to_complete`` and
  ``complete`` (complete and verify by GetObjectAttributes).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import defaultdict
from datetime import datetime
from typing import Any

MiB = 1024 * 1024
RESTORE_TOOLS = {"shardvault-restore", "pgbackrest-restore"}
OBJECT_TARGET_SIZE = 256 * MiB
PHASES = ("checkpoint", "plan", "upload", "tail", "finalize")
OBJECT_STEPS = (
    "wait_checksum",
    "pack",
    "to_sign",
    "sign",
    "to_upload",
    "wait_upload",
    "upload",
    "to_complete",
    "complete",
)
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
    runs: list[dict[str, Any]], others: list[dict[str, Any]]
) -> dict[str, float] | None:
    """Spread of ``run / other`` over the rounds both ran (pairs by ``round``)."""
    by_round = {other["round"]: other["seconds"] for other in others}
    values = [run["seconds"] / by_round[run["round"]] for run in runs if run["round"] in by_round]
    return spread(values) if values else None


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
            ck, up = agent[("pack", key)], agent[("upload", key)]
            d_ck, d_up = dispatched[("pack", key)], dispatched[("upload", key)]
            sign, complete = control[("sign", key)], control[("complete", key)]
        except KeyError:
            continue  # a step without a record (a failed try): no timeline for this object
        out.append(
            {
                "object": key.rsplit("/", 1)[-1],
                "dispatched_at": d_ck["end"],
                "wait_checksum": ck["start"] - d_ck["end"],
                "pack": ck["end"] - ck["start"],
                "to_sign": sign["start"] - ck["end"],
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
        tools[tool] = {
            "label": labels[tool],
            "seconds": spread(seconds),
            "bytes": median_of(tool_runs, "bytes"),
            "objects": None
            if any(run["objects"] is None for run in tool_runs)
            else median_of(tool_runs, "objects"),
            "mib_per_s": median_of(tool_runs, "bytes") / statistics.median(seconds) / MiB,
            "client_cpu_seconds": median_of(tool_runs, "client_cpu_seconds"),
            "minio_cpu_seconds": median_of(tool_runs, "minio_cpu_seconds"),
            "load_before": spread([run["load_before"] for run in tool_runs]),
        }
    shardvault = tools.get("shardvault")
    summary: dict[str, Any] = {"tools": tools}
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
            "tail_bytes": median_of(sv_runs, "tail_bytes"),
            "object_steps": {
                step: statistics.median(o[step] for r in sv_runs for o in r["objects_steps"])
                for step in OBJECT_STEPS
            },
        }
    return summary


def _s(value: float) -> str:
    return f"{value:.1f}"


def _ratio_spread(values: dict[str, float] | None) -> str:
    if not values:
        return "—"
    return " / ".join(f"{values[k]:.2f}" for k in ("min", "median", "max"))


def _mib(value: float) -> str:
    return f"{value / MiB:,.0f}"


def tools_table(summary: dict[str, Any]) -> str:
    ratios = summary.get("ratios", {})
    pairs = summary.get("pair_ratios", {})
    target = summary.get("shardvault", {}).get("object_target")
    rows = [
        "| tool | wall s min / median / max | MiB/s (median) | MiB moved | objects "
        f"(target {target}) | client CPU s | MinIO CPU s | load avg before | ShardVault ÷ tool "
        "(medians) | ShardVault ÷ tool per round (min / median / max) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for tool, info in summary["tools"].items():
        spread_s = " / ".join(_s(info["seconds"][k]) for k in ("min", "median", "max"))
        ratio = ratios.get(f"shardvault/{tool}")
        pair = pairs.get(f"shardvault/{tool}")
        objects = "—" if info["objects"] is None else f"{info['objects']:.0f}"
        rows.append(
            f"| {info['label']} | {spread_s} | {info['mib_per_s']:.0f} | {_mib(info['bytes'])} | "
            f"{objects} | {_s(info['client_cpu_seconds'])} | "
            f"{_s(info['minio_cpu_seconds'])} | {_s(info['load_before']['min'])} to "
            f"{_s(info['load_before']['max'])} | {f'{ratio:.2f}' if ratio else '—'} | "
            f"{_ratio_spread(pair)} |"
        )
    return "\n".join(rows)


def shardvault_table(summary: dict[str, Any]) -> str:
    sv = summary["shardvault"]
    phases, agent = sv["phases"], sv["agent"]
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
        f"| agent: checksum (read + CRC64NVME), wall (sum over objects) | "
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
        return f" (per round: {_ratio_spread(pairs[key])})" if pairs.get(key) else ""

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


def markdown(summary: dict[str, Any]) -> str:
    parts = [tools_table(summary)]
    if "shardvault" in summary:
        parts += [
            "Ratios (of the medians; in brackets, min / median / max of the per-round ratios):"
            "\n\n" + ratios_text(summary)
        ]
        parts += [shardvault_table(summary)]
    return "\n\n".join(parts) + "\n"
