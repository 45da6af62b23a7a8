# One image for every Corral service in docker-compose.yml: the API, the orchestrator, the lane workers
# and the embedded engine (CPU torch). The vLLM service uses vLLM's own image.
FROM python:3.11-slim-bookworm

# bubblewrap: sandbox isolation; util-linux: setpriv (sandbox uids); procps: ps for operators.
RUN apt-get update \
    && apt-get install -y --no-install-recommends bubblewrap util-linux procps \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/corral
COPY pyproject.toml README.md alembic.ini ./
COPY app ./app
COPY workers ./workers
COPY migrations ./migrations
COPY templates ./templates
# The dashboard's htmx and the API docs' Swagger UI, as `make install` (npm ci) left them in the build
# context (.dockerignore lets in only the files served): run `make install` before `docker compose build`.
COPY node_modules ./node_modules
# Editable: templates/ and migrations/ are found beside the package, as in a checkout.
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu -e .

# Sandbox work dirs must be reachable (o+x) by the per-sandbox uids.
RUN mkdir -p /var/lib/corral/sandboxes /var/lib/corral/tasks /var/lib/corral/prometheus \
    && chmod 711 /var/lib/corral /var/lib/corral/sandboxes
ENV CORRAL_DATA_DIR=/var/lib/corral

CMD ["corral", "--help"]
