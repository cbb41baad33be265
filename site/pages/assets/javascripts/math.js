// Render the math that pymdownx.arithmatex leaves in the page with the bundled KaTeX.
// Runs on every page load, including Material's instant navigation (document$).
(function () {
  function render(root) {
    if (typeof katex === "undefined") return;
    root.querySelectorAll(".arithmatex").forEach(function (el) {
      if (el.dataset.rendered) return;
      var tex = el.textContent.trim();
      var display = el.tagName === "DIV";
      tex = tex.replace(/^\\\(|\\\)$/g, "").replace(/^\\\[|\\\]$/g, "");
      try {
        katex.render(tex, el, { displayMode: display, throwOnError: false });
        el.dataset.rendered = "1";
      } catch (e) {
        el.title = String(e);
      }
    });
  }
  if (typeof document$ !== "undefined") {
    document$.subscribe(function () { render(document); });
  } else {
    document.addEventListener("DOMContentLoaded", function () { render(document); });
  }
})();
