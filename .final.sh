export PYTHONPATH=. CUPYQUANT_REQUIRE_GPU=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
timeout 400 python -m pytest -q -m "not large" --deselect tests/test_jit.py -p no:cacheprovider 2>&1 | tail -4 > $OUT/suite.log; tail -1 $OUT/suite.log
timeout 60 python -m pytest -q -m large tests/test_large.py -k weight -p no:cacheprovider 2>&1 | tail -1
SANITIZE_LOG_DIR=/tmp/san SANITIZE_ARGS="--family weight" timeout 100 bash scripts/sanitize.sh memcheck racecheck initcheck synccheck 2>&1 | tail -6 | tee $OUT/sanitize.txt
timeout 100 python scripts/bench.py --matmul --reps 50 --matmul-ms 1,2,4,8,16 --markdown $OUT/bench_matmul.md > $OUT/bench_matmul.log 2>&1; echo bench rc $?
timeout 150 python scripts/bench.py --matmul --matmul-schemes int4 --matmul-ms 1,16,64,256,1024,4096 --markdown $OUT/bench_prefill.md > $OUT/bench_prefill.log 2>&1; echo prefill rc $?
