#!/usr/bin/env bash
# A Debian base image made from Debian's packages alone, for machines that reach a Debian mirror but no
# container registry. It holds python3 and venv (what docker/Dockerfile needs of its BASE), nothing else.
#
#   docker/make-base.sh [IMAGE]          # default localhost/reshard-base:bookworm; needs root, debootstrap, podman
#   buildah build --isolation chroot --build-arg BASE=localhost/reshard-base:bookworm \
#       -f docker/Dockerfile --target service -t reshard-service .
#
# SUITE (default bookworm: python 3.11) and MIRROR (default http://deb.debian.org/debian) choose the release.
set -euo pipefail

IMAGE=${1:-localhost/reshard-base:bookworm}
SUITE=${SUITE:-bookworm}
MIRROR=${MIRROR:-http://deb.debian.org/debian}

for tool in debootstrap podman; do
  command -v "$tool" >/dev/null || { echo "make-base.sh: $tool is missing: apt-get install -y $tool" >&2; exit 2; }
done
[ "$(id -u)" = 0 ] || { echo "make-base.sh: debootstrap needs root (run with sudo)" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/var/tmp}/reshard-base.XXXXXX")
trap 'rm -rf "$work"' EXIT
echo "[1/3] debootstrap $SUITE (minbase + python3, venv, ca-certificates) from $MIRROR"
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$work/rootfs" "$MIRROR"
echo "[2/3] trim apt caches and docs"
rm -rf "$work"/rootfs/var/cache/apt/archives/*.deb "$work"/rootfs/var/lib/apt/lists/* \
       "$work"/rootfs/usr/share/doc/* "$work"/rootfs/usr/share/man/* "$work"/rootfs/usr/share/locale/*
echo "[3/3] import as $IMAGE"
tar --numeric-owner -C "$work/rootfs" -c . \
  | podman import --change 'ENV LANG=C.UTF-8' \
      --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
      --change 'CMD ["/bin/bash"]' - "$IMAGE"
podman image ls "$IMAGE"
