#!/bin/bash
# Build CRIU from Debian's source package plus the patches in criu/patches/, into a private prefix.
#
# Rebuilds only when the version or a patch changes: the stamp file in the prefix records a hash
# of (version, sha256 of the upstream tarball, every patch, this script).
#
#   criu/build.sh [PREFIX]      default PREFIX: $BUNSHIN_HOME/criu (BUNSHIN_HOME default /var/lib/bunshin)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
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
# the upstream tarball, checked against ORIG_SHA256 (by its own script, outside the stamp: a change
# to how the tarball is fetched rebuilds nothing)
"$HERE/fetch-source.sh" "$VERSION" "$DEBREV" "$ORIG_SHA256" "$WORK"

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
