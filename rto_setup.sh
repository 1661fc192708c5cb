#!/usr/bin/env bash
# Network tuning for the workers of a multi-host TPU job: run once on every worker, as root,
# before the job (e.g. multihost_runner command="sudo bash rto_setup.sh && ...").
#
#   sudo bash rto_setup.sh              # apply; prints each change, or that there is none
#   bash rto_setup.sh DRY_RUN=1         # only print what would change; no root needed
#
# What it sets, and why:
#   default route  rto_min 5ms   TCP's retransmit timeout floor is 200 ms: one lost packet between
#                                hosts would stall a cross-host collective (and so every chip) that long
#                  quickack 1    acknowledge at once instead of delaying ACKs, which otherwise adds
#                                up to ~40 ms to the small request/response exchanges of collectives
#   net.ipv4.tcp_slow_start_after_idle=0   keep the congestion window over the idle gaps between steps
#   net.ipv4.tcp_no_metrics_save=1         do not start new connections from an old one's (bad) metrics
#   ethtool tx-nocache-copy on (the default route's device)   cheaper copies of large sends
# Rerunning changes nothing. None of it survives a reboot: run it again after one.
# The commands come from PATH (ip, sysctl, ethtool, id), so tests can put fakes in front.
set -euo pipefail

RTO_MIN="5ms"
SYSCTLS=("net.ipv4.tcp_slow_start_after_idle=0" "net.ipv4.tcp_no_metrics_save=1")
DRY_RUN="${DRY_RUN:-0}"

for arg in "$@"; do
  case "$arg" in
    DRY_RUN=*) DRY_RUN="${arg#*=}" ;;  # KEY=VALUE, as the recipes and setup.sh take it
    --dry-run) DRY_RUN=1; echo "warning: '--dry-run' is deprecated; use 'DRY_RUN=1'" >&2 ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) echo "error: rto_setup.sh: unknown argument '$arg' (expected DRY_RUN=1)" >&2; exit 2 ;;
  esac
done

fail() {
  echo "error: rto_setup.sh: $*" >&2
  exit 2
}

if [[ "$DRY_RUN" != "1" && "$(id -u)" != "0" ]]; then
  fail "must run as root to change the route and the sysctls: sudo bash $0 (or DRY_RUN=1 to see the changes)"
fi

CHANGES=()   # "description|command" pairs, applied in order after everything was read

# The default route's words without its rto_min / quickack settings. `ip` prints a locked
# rto_min as "rto_min lock 5ms", so "lock" may stand between the name and the value.
route_without_tuning() {
  local skip=0 word
  local -a kept=()
  for word in $1; do
    if (( skip > 0 )); then
      skip=$((skip - 1))
      [[ "$word" == "lock" ]] && skip=1
      continue
    fi
    case "$word" in
      rto_min|quickack) skip=1 ;;
      *) kept+=("$word") ;;
    esac
  done
  echo "${kept[*]}"
}

plan_route() {
  local route rto quickack
  # sed, not head: head exits early, and under pipefail the writer's SIGPIPE would fail the script.
  route="$(ip route show default | sed -n 1p)"
  [[ -n "$route" ]] || fail "no default route (ip route show default printed nothing)"
  rto="$(sed -n 's/.* rto_min \(lock \)\{0,1\}\([^ ]*\).*/\2/p' <<<"$route ")"
  quickack="$(sed -n 's/.* quickack \([^ ]*\).*/\1/p' <<<"$route ")"
  if [[ "$rto" != "$RTO_MIN" || "$quickack" != "1" ]]; then
    CHANGES+=("default route: rto_min ${rto:-unset} -> $RTO_MIN, quickack ${quickack:-unset} -> 1|ip route change $(route_without_tuning "$route") rto_min $RTO_MIN quickack 1")
  fi
  DEVICE="$(sed -n 's/.* dev \([^ ]*\).*/\1/p' <<<"$route ")"
}

plan_sysctls() {
  local setting key want have
  for setting in "${SYSCTLS[@]}"; do
    key="${setting%%=*}"
    want="${setting#*=}"
    have="$(sysctl -n "$key")"
    if [[ "$have" != "$want" ]]; then
      CHANGES+=("$key: $have -> $want|sysctl -q -w $setting")
    fi
  done
}

plan_nic() {
  local state
  if [[ -z "$DEVICE" ]] || ! command -v ethtool >/dev/null 2>&1; then
    echo "rto_setup: skipping tx-nocache-copy (no ethtool or no device on the default route)"
    return
  fi
  state="$(ethtool -k "$DEVICE" | sed -n 's/^tx-nocache-copy: *//p')"
  case "$state" in
    on*|*fixed*|"") ;;  # already on, not changeable on this NIC, or not offered at all
    *) CHANGES+=("$DEVICE tx-nocache-copy: $state -> on|ethtool -K $DEVICE tx-nocache-copy on") ;;
  esac
}

DEVICE=""
plan_route
plan_sysctls
plan_nic

if (( ${#CHANGES[@]} == 0 )); then
  echo "rto_setup: nothing to change: this worker is already tuned"
  exit 0
fi
verb="changing"
[[ "$DRY_RUN" == "1" ]] && verb="would change (dry run)"
for change in "${CHANGES[@]}"; do
  echo "rto_setup: $verb ${change%%|*}"
  echo "  \$ ${change#*|}"
  if [[ "$DRY_RUN" != "1" ]]; then
    # Word splitting is intended: each command was assembled from single words above.
    # shellcheck disable=SC2086
    ${change#*|}
  fi
done
echo "rto_setup: done (${#CHANGES[@]} change(s)$([[ "$DRY_RUN" == "1" ]] && echo ", none applied"))"
