# Sourced by the GPU machine's bench scripts (restore-bench-gpu, mustshow-gpu): installs the
# wheels carried in .whl/ (cffi, pycparser; kvikio-cu13, libkvikio-cu13 and rapids-logger into
# /tmp/p2phub-kvikio, on PYTHONPATH), then the checkout and its CUDA backend. Needs $top, $py.
kv=/tmp/p2phub-kvikio
if [ -d "$top/.whl" ]; then
    "$py" -m pip install -q --no-index --find-links "$top/.whl" cffi pycparser
    "$py" -m pip install -q --no-deps --target "$kv" "$top"/.whl/kvikio_cu13-*.whl \
        "$top"/.whl/libkvikio_cu13-*.whl "$top"/.whl/rapids_logger-*.whl
    export PYTHONPATH="$kv${PYTHONPATH:+:$PYTHONPATH}"
    export LD_LIBRARY_PATH="$kv/libkvikio/lib64:$kv/rapids_logger/lib64${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
(cd "$top" && "$py" -m pip install -q --no-deps --no-build-isolation ./ ./backends/cuda)
