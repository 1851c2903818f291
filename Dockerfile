# tracetap: the capture proxy as a container image.
#   docker build -t tracetap .
#   docker run -e TRACETAP_UPSTREAM=http://host:8000/v1 -e TRACETAP_ADMIN_TOKEN=... -p 8080:8080 tracetap
# Every setting is a TRACETAP_* variable (see proxy/runtime/settings.py); docker-compose.yml shows a full stack.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Runtime overlay patches run in bubblewrap (docs/overlays.md). It needs user namespaces,
# which some container runtimes refuse: the proxy then refuses patches, saying why
# (docs/deploy.md).
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends bubblewrap \
    && rm -rf /var/lib/apt/lists/*

# Every dependency ships manylinux wheels, so no compiler is needed. The source tree is
# only the build input: it is removed in the same layer, the installed package stays.
COPY pyproject.toml README.md /src/
COPY proxy /src/proxy
COPY storage /src/storage
COPY exporters /src/exporters
COPY migrations /src/migrations
COPY demo /src/demo
COPY viewer /src/viewer
RUN pip install /src \
    && rm -rf /src \
    && groupadd --system --gid 10001 tracetap \
    && useradd --system --uid 10001 --gid tracetap --home-dir /home/tracetap --create-home \
       --shell /usr/sbin/nologin tracetap \
    && mkdir -p /data \
    && chown tracetap:tracetap /data

# Inside a container the proxy must listen on all interfaces; `serve` then refuses to
# start without TRACETAP_ADMIN_TOKEN, so the admin API is never open by accident.
ENV TRACETAP_HOST=0.0.0.0 \
    TRACETAP_PORT=8080 \
    TRACETAP_DATA_DIR=/data

# The journal (and the SQLite database when TRACETAP_DB is unset) live here. The
# directory is owned by the runtime user before it is declared, so a fresh named
# volume inherits that ownership.
VOLUME ["/data"]
WORKDIR /data
# Numeric, so Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
EXPOSE 8080

# slim has no curl; python's urllib raises (exit 1) on a refused connection or non-2xx.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/healthz' % os.environ.get('TRACETAP_PORT', '8080'), timeout=4)"]

# Exec form: tracetap is PID 1 and receives SIGTERM itself, which drains in-flight
# calls and the capture queue before exiting (TRACETAP_DRAIN_TIMEOUT, default 30 s).
ENTRYPOINT ["tracetap"]
CMD ["serve"]
