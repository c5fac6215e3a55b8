# specserve, CPU image.
#   docker build -t specserve:0.1.0 .
#   docker run -p 8000:8000 -v specserve-cache:/cache specserve:0.1.0 [--model-path ... more `specserve serve` flags]
# Every flag can also come from the environment: SPECSERVE_<FLAG_UPPER_SNAKE>, e.g. SPECSERVE_MAX_NUM_STEPS=3.
# Runs as uid 1000 and works with a read-only root filesystem: it writes only to /cache and /tmp.

ARG PYTHON_VERSION=3.11

FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# The CPU torch wheel first: a plain `pip install torch` would pull the multi-GB CUDA build.
RUN pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
WORKDIR /src
COPY pyproject.toml README.md ./
COPY specserve_pkg/ specserve_pkg/
COPY engine/ engine/
COPY api/ api/
COPY plugins/ plugins/
RUN pip install . && specserve --help > /dev/null

FROM python:${PYTHON_VERSION}-slim-bookworm
# gcc builds our C kernels for the machine the container runs on (-march=native), once, into the cache
# volume (engine/c_library.py): paged-decode attention and int4 matmul; without it decodes take torch's
# slower attention and int4 layers PyTorch's kernel.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN groupadd --gid 1000 specserve \
    && useradd --uid 1000 --gid 1000 --create-home --home-dir /home/specserve --shell /usr/sbin/nologin specserve \
    && mkdir -p /cache \
    && chown 1000:1000 /cache
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    SPECSERVE_CACHE_DIR=/cache/specserve \
    HF_HOME=/cache/huggingface \
    XDG_CACHE_HOME=/cache/xdg \
    SPECSERVE_HOST=0.0.0.0 \
    SPECSERVE_PORT=8000 \
    SPECSERVE_DEVICES=cpu
USER 1000:1000
WORKDIR /home/specserve
VOLUME ["/cache"]
EXPOSE 8000
HEALTHCHECK --interval=30s --timeout=5s --start-period=10m --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["specserve", "serve"]
