"""Per-replica fault tolerance through torchft, as plain numbers and commands (torch-free).

With fault_tolerance=torchft, the configured layout's dp_replicate groups become torchft replica groups: each is
its own torchrun job with dp_replicate=1 (`group_layout`), knows its `replica_id`, and reads the data of its own
replica's shards (runner/run/ft.py's `data_coords`), while a torchft lighthouse (`lighthouse_command`) keeps the quorum. The rules
that refuse what cannot work are in runner/config/validate/fault_tolerance_rules.py; docs/fault-tolerance.md says why.
"""

from __future__ import annotations

import dataclasses
from urllib.parse import urlsplit

from runner.schema import FaultTolerance, RunConfig
from runner.schema.layout import Layout


def enabled(cfg: RunConfig) -> bool:
    return cfg.fault_tolerance.name == FaultTolerance.torchft


def group_layout(lay: Layout) -> Layout:
    """One replica group's torchrun job: the layout with dp_replicate=1 (TorchTitan's TorchFTManager expects it)."""
    return dataclasses.replace(lay, dp_replicate=1)


def lighthouse_address(cfg: RunConfig, host: str) -> str:
    """The lighthouse the replica groups talk to: the configured one, or the one the runner starts on `host`."""
    f = cfg.fault_tolerance
    return f.lighthouse or f"http://{host}:{f.lighthouse_port}"


LOOPBACK = "127.0.0.1"
WILDCARDS = ("0.0.0.0", "::", "[::]")


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"


def lighthouse_bind(cfg: RunConfig) -> tuple[str, str]:
    """(host:port the lighthouse listens on, why that address). One machine: loopback, nothing outside it can
    reach the quorum; a cluster: the address the replica groups use (the host of fault_tolerance.lighthouse); either
    way fault_tolerance.lighthouse_bind when set."""
    f = cfg.fault_tolerance
    if f.lighthouse_bind:
        return _host_port(f.lighthouse_bind, f.lighthouse_port), "fault_tolerance.lighthouse_bind"
    if cfg.cluster.num_nodes == 1 and not f.lighthouse:
        return _host_port(LOOPBACK, f.lighthouse_port), "loopback: every replica group runs on this machine"
    url = urlsplit(f.lighthouse) if f.lighthouse else None
    host, port = (url.hostname, url.port or f.lighthouse_port) if url and url.hostname else ("<lighthouse host>", f.lighthouse_port)
    return _host_port(host, port), "the address the replica groups use (fault_tolerance.lighthouse)"


def local_address(cfg: RunConfig) -> str:
    """The lighthouse the replica groups of a run on one machine talk to: the configured one, or the runner's on
    the host it binds to (loopback where it listens on every interface)."""
    f = cfg.fault_tolerance
    host = f.lighthouse_bind if f.lighthouse_bind and f.lighthouse_bind not in WILDCARDS else LOOPBACK
    return lighthouse_address(cfg, f"[{host}]" if ":" in host and not host.startswith("[") else host)


def lighthouse_command(cfg: RunConfig) -> list[str]:
    """torchft's own lighthouse binary (bundled in the torchft wheel) for this run."""
    f = cfg.fault_tolerance
    return [
        "torchft_lighthouse",
        f"--min_replicas={f.min_replicas}",
        "--quorum_tick_ms=100",
        f"--join_timeout_ms={f.join_timeout_ms}",
        f"--heartbeat_timeout_ms={f.heartbeat_timeout_ms}",
        f"--bind={lighthouse_bind(cfg)[0]}",
    ]


def env(cfg: RunConfig, lighthouse: str) -> dict[str, str]:
    """What every rank of every replica group receives: the lighthouse and torchft's timeouts."""
    f = cfg.fault_tolerance
    return {
        "TORCHFT_LIGHTHOUSE": lighthouse,
        "TORCHFT_TIMEOUT_SEC": str(f.timeout_s),
        "TORCHFT_QUORUM_TIMEOUT_SEC": str(f.quorum_timeout_s),
        "TORCHFT_CONNECT_TIMEOUT_SEC": str(f.connect_timeout_s),
        "RUST_LOG": "warn",  # torchft's Rust side logs every quorum and commit at info; warnings and errors remain
    }


def replica_dir_name(replica_id: int) -> str:
    """The sub-folder of the run folder that holds one replica group's frozen file, rank records, logs and checkpoints."""
    return f"replica_{replica_id}"
