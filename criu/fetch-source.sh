#!/bin/bash
# Fetch CRIU's upstream tarball as Debian ships it (criu_VERSION.orig.tar.xz) into WORK, unless
# a copy with the right SHA-256 is there already. Called by criu/build.sh.
#
#   criu/fetch-source.sh VERSION DEBREV SHA256 WORK
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../scripts/lib/host.sh
source "$HERE/../scripts/lib/host.sh"
VERSION=$1 DEBREV=$2 ORIG_SHA256=$3 WORK=$4
say() { printf '\033[1m[criu]\033[0m %s\n' "$*"; }
mkdir -p "$WORK"
cd "$WORK"
tarball=criu_$VERSION.orig.tar.xz
# Where the upstream tarball is looked for, in order; whatever comes is checked against
# ORIG_SHA256, so none of these needs to be trusted:
#  1. the pool of the Debian archive apt uses (a file stays there while any suite lists it);
#  2. snapshot.debian.org by the file's SHA-1 (kept for good, once sid has moved past $VERSION);
#  3. apt's source index of sid (deb-src only, no binaries), read with the archive's expiry
#     check off: a snapshot mirror serves a sid Release file past its Valid-Until date, which
#     made `apt-get update` fail on a fresh machine of such a mirror (the tarball's checksum,
#     not the index's freshness, is what is relied on).
#: the tarball's SHA-1, snapshot.debian.org's name for it (its .dsc lists it)
declare -A SHA1=([4.2.1]=943aa42a53e9678fee0c8cb85c544afa2d331229)
have_tarball() { echo "$ORIG_SHA256  $tarball" | sha256sum -c --status - 2>/dev/null; }
download() {  # download URL: into $tarball, kept only if its checksum matches
	python3 - "$1" "$tarball.part" <<'EOP' || { rm -f "$tarball.part"; return 1; }
import sys, urllib.request
try:
    with urllib.request.urlopen(sys.argv[1], timeout=60) as r, open(sys.argv[2], "wb") as f:
        while chunk := r.read(1 << 16):
            f.write(chunk)
except OSError as e:  # URLError and HTTPError included: one line, not a traceback
    sys.exit(f"  {sys.argv[1]}: {e}")
EOP
	mv "$tarball.part" "$tarball"
	have_tarball || { say "  $1: wrong checksum, not used"; rm -f "$tarball"; return 1; }
}
if ! have_tarball; then
	rm -f "$tarball"
	archive=$(debian_archive)
	tried=()
	for url in ${archive:+"${archive%/}/pool/main/c/criu/$tarball"} ${SHA1[$VERSION]:+"https://snapshot.debian.org/file/${SHA1[$VERSION]}"}; do
		say "downloading criu $VERSION source: $url"
		tried+=("$url")
		download "$url" && break
	done
	if ! have_tarball && [ -n "$archive" ]; then
		say "asking apt for criu $VERSION through Debian sid's source index (deb-src only) from $archive"
		tried+=("apt-get source criu=$VERSION-$DEBREV (sid's source index from $archive)")
		cat > /etc/apt/sources.list.d/bunshin-criu-src.sources <<EOS
Types: deb-src
URIs: $archive
Suites: sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
		# only this list is read again, and a Release file past its date is taken
		apt-get update -q -o Acquire::Check-Valid-Until=false \
			-o Dir::Etc::sourcelist=/etc/apt/sources.list.d/bunshin-criu-src.sources \
			-o Dir::Etc::sourceparts=- -o APT::Get::List-Cleanup=0 || true
		apt-get source -q --download-only "criu=$VERSION-$DEBREV" || true
	fi
	have_tarball || {
		say "could not get $tarball (sha256 $ORIG_SHA256); tried:"
		printf '  %s\n' "${tried[@]}" >&2
		say "set BUNSHIN_MIRROR to a Debian mirror that has it, or put the file in $WORK"
		exit 1
	}
fi

