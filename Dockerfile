# The image the KubeRay manifests (infra/kuberay/) run: this repository at /app, installed on Ray's own GPU image.
#
#   docker build -t ghcr.io/example/genrec-batch:0.1.0-ray2.60.0 .
#   docker push ghcr.io/example/genrec-batch:0.1.0-ray2.60.0
#
# Tag: <project version>-ray<Ray version>. Every version is constraints.txt's (pyproject.toml declares ranges); this
# file and the manifests must agree with it (tests/test_infra.py checks that). The base has exactly the pinned Ray,
# so `pip install .` keeps it and the head and workers all run one Ray version.
# No models, data or secrets: models and data are read from s3:// at run time (infra/configs/), credentials come
# from the pods' environment (a Kubernetes Secret or the node's IAM role). .dockerignore keeps the rest out.
FROM rayproject/ray:2.60.0-py311-gpu

# The base image runs as user `ray` (uid 1000, group `users`) with Python and pip in /home/ray/anaconda3.
USER root
RUN mkdir -p /app && chown ray:users /app
USER ray
WORKDIR /app

# torch first, in its own layer (the largest one, cached across code changes). The default PyPI wheel for Linux
# x86_64 is the CUDA build and brings its own CUDA runtime libraries; the GPU nodes only need the NVIDIA driver.
COPY --chown=ray:users constraints.txt /app/constraints.txt
RUN pip install --no-cache-dir -c constraints.txt torch

# Then the project (non-editable). /app keeps the sources and the example configs (infra/configs/); the nightly's own
# config is not baked in: the RayJob reads it from a ConfigMap mounted at /etc/genrec (or from s3://), so changing it
# needs no rebuild (docs/nightly.md, "Where the config lives").
COPY --chown=ray:users . /app
RUN pip install --no-cache-dir -c constraints.txt . && python -m jobs.nightly --help > /dev/null
