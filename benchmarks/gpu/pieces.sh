# The SmolLM2 GGUF (98 MB) travels to a GPU machine in pieces: a `device` call carries the working
# tree and one ignored folder, 64 MiB in all. Sourced by checklist.sh and smollm2_drafts.sh.
#
#   cut_gguf GGUF   # dev machine, in the repository root: cuts GGUF into gg.00, gg.01, ... over
#                   # .gpu1, .gpu2, ... (as many as it takes; the files already in .gpu1 and .gpu2 count) so that
#                   # each folder and the working tree fit one call; .gpu1/gg.count says how many
#   join_gguf W SHA # GPU machine: W/model.gguf from the pieces staged into W, once all of them are
#                   # there (returns 1 and says which are missing otherwise), checked against SHA

cut_gguf() {
  local g=$1 tree limit extra=0 n total p i used size off=0
  tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
  limit=$(( 63 * 1048576 - tree ))  # a MiB of margin under the call's 64 MiB
  rm -f .gpu[0-9]/gg.[0-9]* .gpu1/gg.count
  for i in 1 2; do [ -d .gpu$i ] && extra=$(( extra + $(du -cb .gpu$i | tail -1 | cut -f1) )); done
  total=$(( $(stat -c %s "$g") + extra ))
  n=$(( (total + limit - 1) / limit ))
  p=$(( (total + n - 1) / n ))  # every folder weighs about the same
  echo $n > .gpu1/gg.count
  for (( i = 1; i <= n; i++ )); do
    mkdir -p .gpu$i
    used=$(du -cb .gpu$i | tail -1 | cut -f1)
    size=$(( p - used ))
    (( i == n )) && size=$(( $(stat -c %s "$g") - off ))
    tail -c +$(( off + 1 )) "$g" | head -c $size > .gpu$i/gg.$(printf %02d $(( i - 1 )))
    off=$(( off + size ))
  done
  for (( i = 1; i <= n; i++ )); do
    echo ".gpu$i: $(( $(du -cb .gpu$i | tail -1 | cut -f1) / 1048576 )) MiB, with the tree $(( ($(du -cb .gpu$i | tail -1 | cut -f1) + tree) / 1048576 )) MiB"
  done
}

join_gguf() {
  local w=$1 sha=$2 n have
  [ -f "$w/model.gguf" ] && return 0
  n=$(cat "$w/gg.count" 2>/dev/null) || { echo "no gg.count in $w: stage piece 1 first"; return 1; }
  have=$(ls "$w"/gg.[0-9]* 2>/dev/null | wc -l)
  if [ "$have" -lt "$n" ]; then echo "$have of $n GGUF pieces staged in $w: stage the others first"; return 1; fi
  cat "$w"/gg.[0-9]* > "$w/model.gguf" && echo "$sha  $w/model.gguf" | sha256sum -c - || { rm -f "$w/model.gguf"; return 1; }
}
