# One image for both roles: the web process (daphne) and the inference worker (GPU).
#   docker compose up --build        (see docker-compose.yml)
FROM python:3.11-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Triton compiles its small launcher stubs with a C compiler when the worker first runs a kernel.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /app

# torch alone in its own layer: PyPI's Linux wheel bundles the CUDA runtime; the driver comes from
# the host through the NVIDIA container toolkit. The web role never imports it.
ARG TORCH_VERSION=2.13.0
RUN pip install "torch==${TORCH_VERSION}"

# Then the rest of the dependencies, read from pyproject.toml so that the list lives in one place.
COPY pyproject.toml ./
RUN python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; \
print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt

COPY . .
RUN useradd --create-home --uid 1000 kog \
    && mkdir -p /app/var /app/cache /models \
    && chown kog /app/var /app/cache /models
USER kog

EXPOSE 8000
# The web role; the worker's command is `python -m inference.worker` (docker-compose.yml).
CMD ["sh", "-c", "python manage.py migrate --noinput && exec python -m playground.serve -b 0.0.0.0 -p 8000"]
