#!/bin/bash
# Build CRIU from Debian's source package plus the patches in criu/patches/, into a private prefix.
#
# Rebuilds only when the version or a patch changes: the stamp file in the prefix records a hash
# of (version, sha256 of the upstream tarball, every patch, this script).
#
#   criu/build.sh [PREFIX]      default PREFIX: $BUNSHIN_HOME/criu (BUNSHIN_HOME default /var/lib/bunshin)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
# shellcheck source=../scripts/lib/host.sh
source "$HERE/../scripts/lib/host.sh"
VERSION=4.2.1
DEBREV=1
ORIG_SHA256=29ec0ee09e296479fe7048c80980e8ef1d0684d0b0204c2b101dfea19f6725b9
PREFIX=${1:-${BUNSHIN_HOME:-/var/lib/bunshin}/criu}
WORK=${BUNSHIN_BUILD:-${BUNSHIN_HOME:-/var/lib/bunshin}/build}/criu

say() { printf '\033[1m[criu]\033[0m %s\n' "$*"; }

stamp=$( { echo "$VERSION $ORIG_SHA256"; cat "$HERE"/patches/*.patch "$0"; } | sha256sum | cut -d' ' -f1)
if [ -x "$PREFIX/sbin/criu" ] && [ "$(cat "$PREFIX/.stamp" 2>/dev/null)" = "$stamp" ]; then
	say "CRIU $VERSION with $(ls "$HERE"/patches/*.patch | wc -l) patch(es) is up to date in $PREFIX"
	exit 0
fi

mkdir -p "$WORK"
cd "$WORK"
tarball=criu_$VERSION.orig.tar.xz
if ! echo "$ORIG_SHA256  $tarball" | sha256sum -c --status - 2>/dev/null; then
	# The source index of sid carries 4.2.1. Only the source index is added: no binaries from sid.
	if ! apt-cache showsrc criu 2>/dev/null | grep -q "^Version: $VERSION-$DEBREV"; then
		archive=$(debian_archive)
		[ -n "$archive" ] || { say "apt knows no Debian archive for bookworm main; set BUNSHIN_MIRROR to one"; exit 1; }
		say "adding Debian sid's source index (deb-src only) from $archive to find criu $VERSION"
		cat > /etc/apt/sources.list.d/bunshin-criu-src.sources <<EOS
Types: deb-src
URIs: $archive
Suites: sid
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOS
		apt-get update -q
	fi
	say "downloading criu $VERSION source"
	# The Debian packaging tarball may be missing from the pool; only the upstream tarball is needed.
	apt-get source -q --download-only "criu=$VERSION-$DEBREV" || true
	echo "$ORIG_SHA256  $tarball" | sha256sum -c - || { say "checksum of $tarball does not match"; exit 1; }
fi

say "unpacking and patching"
rm -rf "criu-$VERSION"
tar xf "$tarball"
cd "criu-$VERSION"
for p in "$HERE"/patches/*.patch; do
	say "  applying $(basename "$p")"
	patch -p1 --quiet < "$p"
done

say "compiling (about a minute on 2 cores)"
make -j"$(nproc)" PREFIX="$PREFIX" criu >"$WORK/build.log" 2>&1 || { tail -30 "$WORK/build.log"; say "build failed, log: $WORK/build.log"; exit 1; }
make install-criu install-compel PREFIX="$PREFIX" >>"$WORK/build.log" 2>&1
echo "$stamp" > "$PREFIX/.stamp"
say "installed $("$PREFIX/sbin/criu" --version | head -1) into $PREFIX"
