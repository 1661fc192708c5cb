"""rto_setup.sh with fake `ip`, `sysctl`, `ethtool` and `id` first on PATH (state kept in files),
so its root check, dry run and idempotence are checked without touching this machine's network."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

FAKES = {
    "id": '[ "$1" = -u ] && echo "${FAKE_UID:-1000}"',
    # Real `ip` prints a route's rto_min as "rto_min lock 5ms".
    "ip": '''echo "ip $*" >> "$FAKE_NET/calls"
case "$1 $2" in
  "route show") cat "$FAKE_NET/route" ;;
  "route change") shift 2; echo "$*" | sed 's/rto_min /rto_min lock /' > "$FAKE_NET/route" ;;
  *) exit 1 ;;
esac''',
    "sysctl": '''echo "sysctl $*" >> "$FAKE_NET/calls"
case "$1" in
  -n) cat "$FAKE_NET/sysctl/$2" ;;
  -q) setting="$3"; echo "${setting#*=}" > "$FAKE_NET/sysctl/${setting%%=*}" ;;
  *) exit 1 ;;
esac''',
    "ethtool": '''echo "ethtool $*" >> "$FAKE_NET/calls"
case "$1" in
  -k) echo "Features for $2:"; echo "tx-nocache-copy: $(cat "$FAKE_NET/nocache")" ;;
  -K) echo "$4" > "$FAKE_NET/nocache" ;;
esac''',
}
ROUTE = "default via 10.128.0.1 dev ens8 proto dhcp src 10.128.0.5 metric 100"


@pytest.fixture
def net(tmp_path: Path) -> Path:
  state = tmp_path / "net"
  (state / "sysctl").mkdir(parents=True)
  (state / "route").write_text(ROUTE + "\n")
  (state / "sysctl" / "net.ipv4.tcp_slow_start_after_idle").write_text("1\n")
  (state / "sysctl" / "net.ipv4.tcp_no_metrics_save").write_text("0\n")
  (state / "nocache").write_text("off\n")
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for name, body in FAKES.items():
    (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
    (bin_dir / name).chmod(0o755)
  return state


def rto_setup(net: Path, *args: str, uid: int = 0, **env: str) -> subprocess.CompletedProcess:
  path = f"{net.parent / 'bin'}{os.pathsep}{os.environ['PATH']}"
  return subprocess.run(["bash", str(REPO / "rto_setup.sh"), *args], capture_output=True, text=True, timeout=30,
                        env={**os.environ, "PATH": path, "FAKE_NET": str(net), "FAKE_UID": str(uid), **env})


def snapshot(net: Path) -> dict[str, str]:
  return {str(p.relative_to(net)): p.read_text() for p in sorted(net.rglob("*")) if p.is_file() and p.name != "calls"}


def changing_calls(net: Path) -> list[str]:
  calls = (net / "calls").read_text().splitlines() if (net / "calls").exists() else []
  return [c for c in calls if c.startswith(("ip route change", "sysctl -q -w", "ethtool -K"))]


def test_refuses_without_root_and_changes_nothing(net):
  before = snapshot(net)
  result = rto_setup(net, uid=1000)
  assert result.returncode == 2
  assert result.stderr.startswith("error: rto_setup.sh: must run as root") and "DRY_RUN=1" in result.stderr
  assert snapshot(net) == before and changing_calls(net) == []


@pytest.mark.parametrize("how", [["DRY_RUN=1"], ["--dry-run"], []], ids=["argument", "old flag", "env"])
def test_dry_run_prints_every_change_and_applies_none(net, how):
  before = snapshot(net)
  result = rto_setup(net, *how, uid=1000, **({} if how else {"DRY_RUN": "1"}))
  assert result.returncode == 0, result.stderr
  deprecated = ["warning: '--dry-run' is deprecated; use 'DRY_RUN=1'"] if how == ["--dry-run"] else []
  assert [line for line in result.stderr.splitlines() if "deprecated" in line] == deprecated
  out = result.stdout
  assert "would change (dry run) default route: rto_min unset -> 5ms, quickack unset -> 1" in out
  assert f"$ ip route change {ROUTE} rto_min 5ms quickack 1" in out
  assert "net.ipv4.tcp_slow_start_after_idle: 1 -> 0" in out and "net.ipv4.tcp_no_metrics_save: 0 -> 1" in out
  assert "ens8 tx-nocache-copy: off -> on" in out and "(4 change(s), none applied)" in out
  assert snapshot(net) == before and changing_calls(net) == []


def test_applies_once_then_reports_nothing_to_change(net):
  first = rto_setup(net)
  assert first.returncode == 0, first.stderr
  assert (net / "route").read_text().strip() == f"{ROUTE} rto_min lock 5ms quickack 1"
  assert (net / "sysctl" / "net.ipv4.tcp_slow_start_after_idle").read_text().strip() == "0"
  assert (net / "sysctl" / "net.ipv4.tcp_no_metrics_save").read_text().strip() == "1"
  assert (net / "nocache").read_text().strip() == "on" and len(changing_calls(net)) == 4
  after_first = snapshot(net)
  second = rto_setup(net)
  assert second.returncode == 0 and "nothing to change: this worker is already tuned" in second.stdout
  assert snapshot(net) == after_first and len(changing_calls(net)) == 4


def test_replaces_an_existing_rto_min_instead_of_adding_a_second(net):
  (net / "route").write_text(f"{ROUTE} rto_min lock 200ms quickack 1\n")
  result = rto_setup(net)
  assert result.returncode == 0, result.stderr
  assert "rto_min 200ms -> 5ms, quickack 1 -> 1" in result.stdout
  assert (net / "route").read_text().strip() == f"{ROUTE} rto_min lock 5ms quickack 1"
