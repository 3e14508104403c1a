// Inline code without spaces (a hook name such as blocks.{layer}.kv_cache.hook_k_full,
// a function name) is kept on one line: browsers would otherwise break it after a dot
// or before a brace. Code with spaces (an error message) still wraps at its spaces.
function keepNamesWhole() {
  document.querySelectorAll(".md-typeset code").forEach((code) => {
    if (code.closest("pre") === null && !/\s/.test(code.textContent)) {
      code.classList.add("whole-name");
    }
  });
}

if (typeof document$ !== "undefined") {
  document$.subscribe(keepNamesWhole);
} else {
  document.addEventListener("DOMContentLoaded", keepNamesWhole);
}
