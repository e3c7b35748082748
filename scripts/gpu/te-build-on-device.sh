#!/usr/bin/env bash
# On the GPU machine (see docs/gpu-recipes.md): reassemble the TransformerEngine core wheel from parts staged in /tmp/te, install it with
# its small deps (and a megatron-core wheel, if staged there) into /tmp/site, and build
# transformer_engine_torch from source for sm_90 (about 90 s on 32 cores). Afterwards: export PYTHONPATH=/tmp/site
set -x
cd /tmp/te && cat $(ls tepart* | sort -V) > transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl
echo "$(cat te.sha)  transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl" | sha256sum -c || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site /tmp/te/*.whl 2>&1 | tail -3
export PYTHONPATH=/tmp/site
which nvcc; nvcc --version | tail -2; export CUDA_HOME=${CUDA_HOME:-$(dirname $(dirname $(readlink -f $(which nvcc))))}
export NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 NVTE_WITH_NCCL_EP=0 MAX_JOBS=32 NVTE_BUILD_THREADS_PER_JOB=1
cd /tmp && rm -rf transformer_engine_torch-2.20.2 && tar xzf /tmp/te/transformer_engine_torch-2.20.2.tar.gz && cd transformer_engine_torch-2.20.2
time python3 -m pip install --no-build-isolation --no-deps --no-index --no-compile --target /tmp/site . 2>&1 | tail -40
# TransformerEngine checks for a `transformer_engine` distribution installed from a wheel; the target
# install above does not provide one, and pip leaves the torch extension out of an existing folder.
d=/tmp/site/transformer_engine-2.20.2.dist-info; mkdir -p $d
printf 'Metadata-Version: 2.1\nName: transformer_engine\nVersion: 2.20.2\n' > $d/METADATA
printf 'Wheel-Version: 1.0\nGenerator: manual\nRoot-Is-Purelib: true\nTag: py3-none-any\n' > $d/WHEEL
echo pip > $d/INSTALLER; printf 'transformer_engine-2.20.2.dist-info/METADATA,,\ntransformer_engine-2.20.2.dist-info/WHEEL,,\n' > $d/RECORD
w=$(ls /root/.cache/pip/wheels/*/*/*/*/transformer_engine_torch-*.whl | head -1)
(cd /tmp/site && python3 -c "import zipfile,sys; zipfile.ZipFile(sys.argv[1]).extractall('.')" "$w")
python3 -c "import transformer_engine.pytorch; from megatron.core.tensor_parallel.gtp_api import HAVE_GTP; print('TransformerEngine ready, HAVE_GTP =', HAVE_GTP)" 2>&1 | tail -1
