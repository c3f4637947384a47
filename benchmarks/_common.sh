# Shell pieces the benchmark scripts share; sourced (". benchmarks/_common.sh") by a script that has set
# $here to the checkout.

# ensure_checkpoint CONFIG DIR [LAYERS]: set up .venv when moestream is not there yet (sets $bin), then
# write the checkpoint DIR by `moestream synth` of CONFIG (at LAYERS layers when given) unless it exists.
ensure_checkpoint() {
  local config=$1 model=$2 layers=${3:-}
  bin=$here/.venv/bin
  [ -x "$bin/moestream" ] || make -C "$here" setup
  if [ ! -d "$model" ]; then
    mkdir -p "$(dirname "$model")"
    "$bin/moestream" synth --config "$config" --out "$model" ${layers:+--layers "$layers"}
  fi
}
