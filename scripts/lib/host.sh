# Host helpers shared by scripts/setup.sh and criu/fetch-source.sh (sourced, not run).

# missing_packages [--admindir DIR] PKG...: print the packages of the list that are not
# installed, one per line. dpkg-query exits 1 as soon as one package is unknown, which is
# the normal case on a fresh machine: that status is read per package, never passed on to
# the caller's `set -e`/`pipefail` (a fresh machine stopped on this line before).
missing_packages() {
	local admin=() p st
	if [ "${1:-}" = --admindir ]; then admin=(--admindir="$2"); shift 2; fi
	for p in "$@"; do
		st=$(dpkg-query "${admin[@]}" -W -f='${db:Status-Abbrev}' "$p" 2>/dev/null) || st=""
		[ "${st:0:2}" = "ii" ] || echo "$p"
	done
}

# debian_archive: the URI of the Debian archive this host's apt uses for bookworm main (a
# local mirror or a proxy where the cluster has one), as `apt-cache policy` shows it.
# BUNSHIN_MIRROR overrides it. Prints nothing when apt knows no such archive.
debian_archive() {
	if [ -n "${BUNSHIN_MIRROR:-}" ]; then echo "$BUNSHIN_MIRROR"; return; fi
	local uri
	uri=$(apt-cache policy 2>/dev/null | awk '$3 == "bookworm/main" && $5 == "Packages" {print $2; exit}') || uri=""
	if [ -z "$uri" ] && [ "$(id -u)" = 0 ]; then  # no lists yet: read them once
		apt-get update -q >/dev/null 2>&1 || true
		uri=$(apt-cache policy 2>/dev/null | awk '$3 == "bookworm/main" && $5 == "Packages" {print $2; exit}') || uri=""
	fi
	echo "$uri"
}
