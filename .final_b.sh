export PYTHONPATH=. CUPYQUANT_REQUIRE_GPU=1
timeout 200 python scripts/bench.py --matmul --reps 50 --matmul-ms 1,2,4,8,16 --markdown $OUT/bench_matmul.md > $OUT/bench_matmul.log 2>&1; echo bench rc $?
SANITIZE_LOG_DIR=$OUT/san SANITIZE_ARGS="--family weight" timeout 200 bash scripts/sanitize.sh memcheck racecheck initcheck synccheck 2>&1 | tail -8
timeout 180 python -m pytest -q -m large tests/test_large.py -k weight -p no:cacheprovider 2>&1 | tail -2
