# One image for the router and the native worker: `python -m epd_actors ...`.
#
#   docker build -t epd-actors .
#   docker run --rm -p 8000:8000 epd-actors local --host 0.0.0.0      # simulated fleet
#   docker run --rm -v $PWD/epd.toml:/etc/epd/epd.toml epd-actors              # the router
#   docker run --rm epd-actors worker --role decode --engine sim --listen tcp://0.0.0.0:9000
#
# The default command serves the router from /etc/epd/epd.toml (the Kubernetes
# manifests in deploy/kubernetes/ mount it from a ConfigMap).  The image has the
# `kubernetes` extra (EndpointSlice discovery); vLLM is not in it: stock
# `vllm serve` workers run from vLLM's own image (deploy/kubernetes/workers/).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
COPY pyproject.toml README.md ./
COPY epd_actors ./epd_actors
RUN pip install '.[kubernetes]' && rm -rf /app/build

# No root at run time; a fixed uid so Kubernetes can check runAsNonRoot.
RUN useradd --uid 10001 --no-create-home --shell /usr/sbin/nologin epd
USER 10001:10001

EXPOSE 8000
ENTRYPOINT ["python", "-m", "epd_actors"]
CMD ["serve", "--config", "/etc/epd/epd.toml"]
