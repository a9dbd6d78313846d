# The Tokenlane gateway image; the compose `sim` profile runs the simulator from it too
# (`tokenlane sim`), so both ship in one install. Build: docker build -t tokenlane:local .

# Build stage: install into a virtualenv so the runtime stage copies one directory and no
# build tooling. uvloop and httptools come as wheels with uvicorn[standard].
FROM python:3.11-slim AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml constraints.txt README.md LICENSE ./
COPY proxy ./proxy
COPY loadtest ./loadtest
# Pinned to the versions the suite passed with (constraints.txt), as `make` and CI install.
RUN python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir -c constraints.txt '.[tokenizer]'

FROM python:3.11-slim
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN useradd --system --uid 10001 --user-group --create-home --shell /usr/sbin/nologin tokenlane
COPY --from=build /opt/venv /opt/venv
# A policy at the default path so the image runs as is; compose mounts ./config over it.
COPY config/policy.compose.yaml /etc/tokenlane/policy.yaml
# Numeric, so that runtimes enforcing non-root (runAsNonRoot) can verify it.
USER 10001:10001
WORKDIR /home/tokenlane
EXPOSE 8080
# The slim image has no curl. /health says the process is up; readiness (/ready) depends on the
# replicas and is for the load balancer in front, not for restarting this container.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('TOKENLANE_SERVER__PORT', '8080') + '/health', timeout=2)"]
# One worker per CPU the container may use (its cgroup quota, else its affinity).
CMD ["tokenlane", "serve", "--config", "/etc/tokenlane/policy.yaml", "--workers", "auto"]
