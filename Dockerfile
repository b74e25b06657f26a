# The kv-epp image the Helm chart runs (charts/kv-epp: image.repository, image.tag or image.digest): kv-epp (the
# picker) and kv-listener, installed from this source tree without the test extras. It is not published and no CI
# builds it: build and push it yourself, then point the chart at it.
#
#   docker build -t <registry>/kv-epp:<tag> .
#   docker push <registry>/kv-epp:<tag>
#   helm install ... --set image.repository=<registry>/kv-epp --set image.tag=<tag>
#
# Build argument KV_EPP_INSTALL (default "."): what pip installs, e.g. ".[local-tokenizer]" for Tier 4's in-process
# tokenizer (kv_cache_index.tokenizer.source: local). Dependencies resolve from pyproject.toml at build time.
# The base is pinned to a Python patch release; pin its digest too for a reproducible build
# (FROM python:3.11.14-slim-bookworm@sha256:<digest>, the digest from `docker buildx imagetools inspect`).

FROM python:3.11.14-slim-bookworm AS build
ARG KV_EPP_INSTALL=.
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/kv-epp
WORKDIR /src
COPY pyproject.toml README.md ./
COPY picker ./picker
COPY listener ./listener
COPY benchmarks ./benchmarks
# pip compiles every module to bytecode at install: the chart's read-only root filesystem needs no writes later
RUN /opt/kv-epp/bin/pip install "${KV_EPP_INSTALL}" \
    && /opt/kv-epp/bin/kv-epp --help >/dev/null \
    && /opt/kv-epp/bin/kv-listener --help >/dev/null

FROM python:3.11.14-slim-bookworm
LABEL org.opencontainers.image.title="kv-epp" \
      org.opencontainers.image.description="kv-epp, a KV-cache-aware endpoint picker, and kv-listener" \
      org.opencontainers.image.licenses="Apache-2.0"
# the user the chart runs as (UID/GID 65532, as distroless' nonroot), with a passwd entry but no home or shell
RUN groupadd --gid 65532 kv-epp \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin kv-epp
COPY --from=build /opt/kv-epp /opt/kv-epp
ENV PATH=/opt/kv-epp/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
WORKDIR /
USER 65532:65532
# ext_proc, gRPC health (plaintext, kubelet probes), admin/metrics; the listener's feed and metrics. The picker
# binds ext_proc and health on 127.0.0.1 unless its config sets extproc.host, and beyond loopback it needs
# extproc.auth.token_file or extproc.tls.client_ca_file (the chart sets host and token: charts/kv-epp).
EXPOSE 9002 9003 9090 7817
CMD ["kv-epp", "--help"]
