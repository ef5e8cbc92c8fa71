#!/bin/bash
# One-time (idempotent) set-up of a Debian 12 host for bunshin-gym, as root.
# A second run checks each step and takes seconds.
#
#   scripts/setup.sh            host packages, CRIU, venv, btrfs pool, default images (base webarena)
#   BUNSHIN_IMAGES="base osworld" scripts/setup.sh    also build these images
#
# Configuration (environment): BUNSHIN_HOME (/var/lib/bunshin), BUNSHIN_POOL_SIZE (60G),
# BUNSHIN_POOL_FILE ($BUNSHIN_HOME/pool.img), BUNSHIN_VENV (<repo>/.venv).
set -Eeuo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source=lib/host.sh
source "$REPO/scripts/lib/host.sh"
export BUNSHIN_HOME=${BUNSHIN_HOME:-/var/lib/bunshin}
VENV=${BUNSHIN_VENV:-$REPO/.venv}
IMAGES=${BUNSHIN_IMAGES:-base webarena osworld}
say() { printf '\033[1m[setup]\033[0m %s\n' "$*"; }
# Every step names itself; a failing command then says which step stopped and why.
STEP="start"
step() { STEP="$*"; }
trap 'rc=$?; printf "\033[1m[setup]\033[0m FAILED in step \"%s\": \"%s\" exited %s (scripts/setup.sh line %s)\n" "$STEP" "$BASH_COMMAND" "$rc" "$LINENO" >&2' ERR

[ "$(id -u)" = 0 ] || { echo "scripts/setup.sh must run as root" >&2; exit 1; }
mkdir -p "$BUNSHIN_HOME"

# 1. Host packages from Debian (only what is missing).
step "1. host packages"
PKGS="btrfs-progs debootstrap iproute2 nftables util-linux procps psmisc kmod xz-utils tar dpkg-dev
 build-essential pkg-config gcc make libc6-dev python3 python3-venv
 libprotobuf-c-dev protobuf-c-compiler libprotobuf-dev protobuf-compiler python3-protobuf
 libnl-3-dev libnet1-dev libcap-dev libbsd-dev libnftables-dev libgnutls28-dev uuid-dev
 debian-archive-keyring ca-certificates
 git curl"  # git: bench containment's --before worktrees; curl: a test reaches the E2B port URL with it
missing=$(missing_packages $PKGS | tr '\n' ' ')
if [ -n "${missing// /}" ]; then
	say "installing host packages: $missing"
	apt-get update -q
	DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $missing
else
	say "host packages present"
fi

step "2. CRIU build"
# 2. CRIU from Debian's source package plus criu/patches (rebuilt only when they change).
"$REPO/criu/build.sh" "$BUNSHIN_HOME/criu"
"$REPO/criu/pycriu.sh" "$BUNSHIN_HOME/criu"  # pycriu, to rewrite image files (snapshot flattening)

step "3. Python virtual environment"
# 3. Python virtual environment: torch's CPU wheel first and alone, then pinned deps.
stamp=$(cat "$REPO/pyproject.toml" "$REPO/constraints.txt" | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.bunshin-stamp" 2>/dev/null)" != "$stamp" ]; then
	say "creating the virtual environment in $VENV"
	[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
	"$VENV/bin/pip" install -q --upgrade pip 2>&1 | grep -v WARNING || true
	torch=$(grep '^torch==' "$REPO/constraints.txt")
	say "installing $torch (CPU wheel) alone, before anything can pull a CUDA build"
	local_wheel=$(ls /opt/wheels/torch-${torch#torch==}+cpu-cp3*.whl 2>/dev/null | head -n 1 || true)
	if [ -n "$local_wheel" ]; then  # machines of this workplace keep the CPU wheel on disk
		"$VENV/bin/pip" install -q "$local_wheel" 2>&1 | grep -v WARNING || true
	else
		"$VENV/bin/pip" install -q "$torch" --index-url https://download.pytorch.org/whl/cpu 2>&1 | grep -v WARNING || true
	fi
	say "installing bunshin-gym (editable) with pinned dependencies"
	"$VENV/bin/pip" install -q -c "$REPO/constraints.txt" -e "$REPO[web,train,dev,serve,integrations,cluster]" > "$VENV/pip.log" 2>&1 ||
		{ tail -n 30 "$VENV/pip.log"; say "pip failed; full log: $VENV/pip.log"; exit 1; }
	# verl's declared pins exclude our transformers and tensordict, yet its agent loop imports and
	# runs with them (tests/integrations/test_verl.py): it alone goes in without its dependencies
	say "installing verl (pinned, --no-deps) for bunshin_gym.integrations.verl"
	"$VENV/bin/pip" install -q --no-deps -c "$REPO/constraints.txt" verl >> "$VENV/pip.log" 2>&1 ||
		{ tail -n 30 "$VENV/pip.log"; say "pip failed (verl); full log: $VENV/pip.log"; exit 1; }
	"$VENV/bin/python" -c "import bunshin_gym, gymnasium, torch, trl, verl.experimental.agent_loop" 
	echo "$stamp" > "$VENV/.bunshin-stamp"
else
	say "virtual environment up to date ($VENV)"
fi
BUNSHIN="$VENV/bin/bunshin"

# 4. btrfs pool in a loop file, mounted; 5. workspace images (cached by recipe).
step "4. btrfs pool"
"$VENV/bin/python" -c "from bunshin_gym.workspace import pool; pool.ensure_pool(say=print)"
step "5. workspace images ($IMAGES)"
"$BUNSHIN" image build $IMAGES
"$BUNSHIN" image prune
step "6. bunshin doctor"
# its last line when all is well; all of it (each failed check with its fix) when not
if report=$("$BUNSHIN" doctor 2>&1); then
	say "done; 'bunshin doctor' checks everything: $(tail -n 1 <<<"$report")"
else
	printf '%s\n' "$report"
	false  # the ERR trap names this step
fi
