#!/usr/bin/env bash
# On a lent GPU machine (the device tool), from the repository root: build dpcuda against that
# machine's own torch and run what only a GPU can, leaving logs, results and the built extension
# under $OUT.   bash scripts/gpu_session.sh STEP...   (default: build test bench so)
#   build     setup.py build_ext --inplace with CXX=/usr/bin/g++ (the image's CXX, a wrapper,
#             links libstdc++ statically, which dpcuda refuses at import; DPCUDA_KEEP_CXX=1 keeps it)
#   carried   use an extension a previous call built, carried in .gpu/dpcuda/
#   test      the whole test suite with pytest-xdist (every device-parametrised test adds cuda:0)
#   check     tests/test_cuda_step.py, and benchmarks/count_launches.py (kernels, syncs per step)
#   sanitize  compute-sanitizer memcheck, racecheck and synccheck over the CUDA tests
#   graphs    the graphed step first (issue #25): its CUDA tests (graphed against eager, 1000
#             replays with a changing lr; steps from two streams; the update's bookkeeping
#             kernels against the torch ops they replace)
#   launches  benchmarks/count_launches.py alone
#   graphsan  memcheck, racecheck and synccheck over the graph replays (SAN_TOOLS narrows it;
#             the bit-for-bit test over GRAPHED_STEPS=14 steps: racecheck did not finish 1000)
#   hostprof  where a replayed graphed step's host time goes (cProfile, SGD and AdamW)
#   stepbench bench_step with its graphed contenders (BENCH_STEP_ARGS narrows it)
#   bench     the layer, step and all-reduce benchmarks on cuda
#   train     the README's main job on the GPU: 1 replica, 2 on one GPU, NCCL under torchrun
#   exc       does a C++ argument check raise a Python ValueError there (GDB=1: a backtrace)
#   so        the built extension, split into 15 MB pieces for $OUT
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD MAX_JOBS=${MAX_JOBS:-16}
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT/res"
PY=${PY:-python3}
steps=("$@"); [ ${#steps[@]} -eq 0 ] && steps=(build test bench so)
log() { echo "[$(date +%T)] $*"; }
for step in "${steps[@]}"; do case $step in
carried)  # the extension a previous call built, carried in .gpu/
  cp .gpu/dpcuda/_C*.so dpcuda/ && log "using the carried extension" ;;
exc)  # does a C++ argument check surface as a Python ValueError (and not a crash)?
  log "compilers: CXX=${CXX:-unset}"; for c in /opt/gcc/bin/g++ /usr/bin/g++; do [ -x $c ] && echo "$c: $($c --version | head -1)"; done
  $PY -c "from dpcuda import parallel
try: parallel.all_reduce([])
except ValueError as e: print('raised ValueError:', e)"; echo "exc rc=$?"
  if [ "${GDB:-0}" = 1 ]; then cuda-gdb -batch -ex run -ex bt --args $PY -c "from dpcuda import parallel; parallel.all_reduce([])" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -40; fi ;;
build)
  # The image sets CXX to a wrapper (/opt/gcc/bin/g++) that links libstdc++ statically.
  if [ -x /usr/bin/g++ ] && [ -z "${DPCUDA_KEEP_CXX:-}" ]; then export CXX=/usr/bin/g++ CC=/usr/bin/gcc; fi
  log "env"; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv
  $PY -c "import torch,sys;print(sys.version.split()[0], torch.__version__, torch.cuda.get_device_name(0))"
  nvcc --version | tail -2
  log "build (TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:=9.0})"; export TORCH_CUDA_ARCH_LIST
  t0=$SECONDS
  $PY setup.py build_ext --inplace >"$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
  log "built in $((SECONDS-t0)) s"
  $PY -c "import dpcuda;print('built_with_cuda', dpcuda.built_with_cuda(), 'cuda_available', dpcuda.cuda_available())" ;;
test)
  log "pytest"
  OMP_NUM_THREADS=1 timeout ${TEST_TIMEOUT:-330} $PY -m pytest -v -n ${XDIST:-12} -p no:cacheprovider --timeout 240 --durations=25 -rfE \
     ${PYTEST_ARGS:---ignore=tests/test_cli_dist.py --ignore=tests/test_soak.py tests} \
     >"$OUT/pytest.log" 2>&1; rc=$?
  log "pytest rc=$rc"; grep -E "(FAILED|ERROR) " "$OUT/pytest.log" | head -60; tail -3 "$OUT/pytest.log" ;;
bench)
  for b in layers step allreduce; do
    log "bench_$b"; timeout ${BENCH_TIMEOUT:-120} $PY benchmarks/bench_$b.py --device cuda \
      --json "$OUT/res/$b-cuda.json" >"$OUT/res/$b-cuda.txt" 2>&1; echo "rc=$?"; tail -30 "$OUT/res/$b-cuda.txt"
  done ;;
check)  # the CUDA step against the CPU path and torch SGD; launches and syncs per step
  log "test_cuda_step + test_build_runtime"; timeout 240 $PY -m pytest -q -p no:cacheprovider tests/test_cuda_step.py tests/test_build_runtime.py 2>&1 | tail -5
  log "count_launches"; timeout 120 $PY benchmarks/count_launches.py --json "$OUT/res/launches.json" 2>&1 | grep -v Warn | tail -12 ;;
sanitize)  # compute-sanitizer: memcheck and racecheck over the CUDA step tests, synccheck over kernel tests
  for tool in memcheck racecheck; do
    log "$tool"; timeout ${SAN_TIMEOUT:-130} compute-sanitizer --tool $tool --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider -k "float64 or faults or torch_sgd" tests/test_cuda_step.py 2>&1 | tail -4; echo "$tool rc=${PIPESTATUS[0]}"
  done
  log "synccheck"; timeout ${SAN_TIMEOUT:-130} compute-sanitizer --tool synccheck --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider -x -k "cuda and not 1048576" tests/test_cross_entropy.py tests/test_parallel.py 2>&1 | tail -4; echo "synccheck rc=${PIPESTATUS[0]}" ;;
graphs)  # DataParallel(graphs=True): what the CPU could not check: its CUDA tests
  log "graphed tests"; timeout ${GRAPH_TIMEOUT:-300} $PY -m pytest -v -p no:cacheprovider -rfE -k "graphed or two_streams or nonblocking_optimizer or (bookkeeping and cuda)" tests/test_cuda_step.py tests/test_optim.py >"$OUT/graphs.log" 2>&1
  log "graphed tests rc=$?"; grep -E "(FAILED|ERROR) " "$OUT/graphs.log" | head -20; tail -3 "$OUT/graphs.log" ;;
launches)  # kernels, graph launches and syncs per step
  log "count_launches"; timeout ${LAUNCH_TIMEOUT:-120} $PY benchmarks/count_launches.py --json "$OUT/res/launches.json" 2>&1 | grep -v Warn | tail -14 ;;
graphsan)  # memcheck, racecheck and synccheck over the graph replays (SAN_TOOLS narrows it)
  for tool in ${SAN_TOOLS:-memcheck racecheck synccheck}; do
    log "$tool over graph replays"; DPCUDA_GRAPHED_STEPS=${GRAPHED_STEPS:-14} timeout ${SAN_TIMEOUT:-300} compute-sanitizer --tool $tool --error-exitcode 9 $PY -m pytest -q -p no:cacheprovider -k "graphed and AdamW and 1" tests/test_cuda_step.py >"$OUT/res/$tool-graphs.txt" 2>&1; echo "$tool rc=$?"; tail -4 "$OUT/res/$tool-graphs.txt"
  done ;;
hostprof)  # where a replayed graphed step's host time goes
  for o in sgd adamw; do log "profile_graphed_host $o"; timeout 90 $PY benchmarks/profile_graphed_host.py --optimizer $o --out "$OUT/res/profile-graphed-$o.txt" 2>&1 | head -3; done ;;
stepbench)  # bench_step with every contender, the graphed ones among them (BENCH_STEP_ARGS narrows it)
  log "bench_step"; timeout ${BENCH_TIMEOUT:-500} $PY benchmarks/bench_step.py --device cuda --json "$OUT/res/step-sync-cuda.json" ${BENCH_STEP_ARGS:-} >"$OUT/res/step-sync-cuda.txt" 2>&1; echo "rc=$?"; tail -40 "$OUT/res/step-sync-cuda.txt" ;;
train)  # the README's main job on the GPU: 1 replica, 2 replicas on it, and NCCL under torchrun
  log "train cuda:0"; timeout 150 $PY -m dpcuda train --no-progress --json "$OUT/res/train-cuda.json" 2>&1 | tail -4
  log "train 2 replicas on cuda:0"; timeout 150 $PY -m dpcuda train --no-progress --replicas 2 --json "$OUT/res/train-cuda-r2.json" 2>&1 | tail -3
  log "torchrun, reducer dist (NCCL), 1 process"; timeout 150 torchrun --standalone --nproc-per-node 1 -m dpcuda train --no-progress --reducer dist --json "$OUT/res/train-nccl.json" 2>&1 | tail -3 ;;
so)
  f=$(ls dpcuda/_C*.so) && tar czf "$OUT/so.tgz" "$f" && split -b 15M "$OUT/so.tgz" "$OUT/so.tgz." && rm "$OUT/so.tgz"
  ls -la "$OUT" ;;
esac; done
tar czf "$OUT/res.tgz" -C "$OUT" res && rm -rf "$OUT/res"
