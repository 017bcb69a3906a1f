# Sourced by the benchmark scripts: `machine_header FILE` writes (and prints) what the machine
# was doing when a run started, so every published number carries its CPU and load.
# The widest vector ISA the kernels can use: "AMD EPYC" has named AVX2-only and AVX-512 machines.
vector_isa() {
  if grep -qw avx512f /proc/cpuinfo; then echo AVX-512
  elif grep -qw avx2 /proc/cpuinfo; then echo AVX2
  else echo "no AVX2"; fi
}
machine_header() {
  local cpu
  cpu=$(lscpu)
  {
    echo "date: $(date -u +%FT%TZ)"
    echo "cpu: $(sed -n 's/^Model name: *//p' <<<"$cpu"), $(nproc) cores," \
      "family $(sed -n 's/^CPU family: *//p' <<<"$cpu") model $(sed -n 's/^Model: *//p' <<<"$cpu")," \
      "$(vector_isa)"
    echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo "other processes over 5% CPU:"
    ps -eo pcpu,comm --sort=-pcpu | awk 'NR > 1 && $1 > 5'
  } | tee "$1"
}
