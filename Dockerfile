# One image per role, built from the stages below (docker-compose.yml picks each with `target:`):
#   web      daphne: the page, the API, the admin. No torch: it never loads a model.
#   worker   the inference worker: torch (PyPI's Linux wheel bundles the CUDA runtime) and Triton.
#   docker compose up --build        (see docker-compose.yml)
FROM python:3.11-slim-bookworm AS base

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app
RUN useradd --create-home --uid 1000 kog
# The dependency list lives in pyproject.toml; scripts/requirements.py prints a role's share of it.
COPY pyproject.toml ./
COPY scripts/requirements.py scripts/


FROM base AS web
RUN python scripts/requirements.py web > /tmp/requirements.txt && pip install -r /tmp/requirements.txt
COPY . .
RUN mkdir -p /app/var \
    && chown kog /app/var
USER kog
EXPOSE 8000
CMD ["sh", "-c", "python manage.py migrate --noinput && exec python -m playground.serve -b 0.0.0.0 -p 8000"]


FROM base AS worker
# Triton compiles its small launcher stubs with a C compiler when the worker first runs a kernel.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
# torch alone in its own layer; the GPU driver comes from the host through the NVIDIA container toolkit.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"
RUN python scripts/requirements.py worker gpu > /tmp/requirements.txt && pip install -r /tmp/requirements.txt
COPY . .
RUN mkdir -p /app/cache /models \
    && chown kog /app/cache /models
USER kog
CMD ["python", "-m", "inference.worker"]
