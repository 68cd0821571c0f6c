// Glossary tooltips (see glossary.css): keep the shown definition inside the content column and
// below the sticky header, and let Escape dismiss it. Works without this file, less tidily.
(function () {
  "use strict";
  function place(link) {
    var tip = link.querySelector(".glossary-tooltip");
    if (!tip) return;
    link.classList.remove("glossary-dismissed");
    tip.classList.remove("glossary-below");
    tip.style.left = "";
    var column = link.closest("article") || document.body;
    var bounds = column.getBoundingClientRect();
    var top = 0; // below every sticky header: the site's bar and the article's own
    document.querySelectorAll(".bd-header-article, .bd-header").forEach(function (header) {
      top = Math.max(top, header.getBoundingClientRect().bottom);
    });
    var box = tip.getBoundingClientRect();
    if (box.width === 0) return; // not shown (e.g. focus without :focus-visible)
    var right = Math.min(bounds.right, document.documentElement.clientWidth);
    var shift = 0;
    if (box.right > right) shift = right - box.right;
    if (box.left + shift < bounds.left) shift = bounds.left - box.left;
    if (shift) tip.style.left = shift + "px";
    if (box.top < top) tip.classList.add("glossary-below");
  }
  function onEnter(event) {
    var link = event.target.closest && event.target.closest("a.glossary-term");
    if (link && !link.contains(event.relatedTarget)) place(link); // entering it, not moving inside
  }
  document.addEventListener("mouseover", onEnter);
  document.addEventListener("focusin", onEnter);
  document.addEventListener("keydown", function (event) {
    if (event.key !== "Escape") return;
    document.querySelectorAll("a.glossary-term").forEach(function (link) {
      link.classList.add("glossary-dismissed");
    });
  });
  document.addEventListener("mouseout", function (event) {
    var link = event.target.closest && event.target.closest("a.glossary-term");
    if (link && !link.contains(event.relatedTarget)) link.classList.remove("glossary-dismissed");
  });
})();
