// The search page's changes to Sphinx's search (book/_ext/search_tuning.py says why). Loaded on search.html
// only, after _static/search_excerpts.js (window.SCALEBOOK_SEARCH) and before searchtools.js, which keeps a
// Scorer that is already defined.
"use strict";

(() => {
  const data = window.SCALEBOOK_SEARCH || {teaches: {}, backMatter: [], excerpts: {}};
  const normalize = (text) => text.trim().split(/\s+/).join(" ").toLowerCase();
  const query = normalize(new URLSearchParams(window.location.search).get("q") || "");
  const padded = ` ${query.replace(/[^\p{Letter}\p{Number}+\-]+/gu, " ")} `;

  // The chapter that teaches the query: its glossary term's first link. A query that is no term but contains
  // terms (as whole words) takes the longest of them.
  const teachingDoc = () => {
    if (data.teaches[query]) return data.teaches[query];
    const contained = Object.keys(data.teaches)
      .filter((term) => padded.includes(` ${term} `))
      .sort((a, b) => b.length - a.length);
    return contained.length ? data.teaches[contained[0]] : null;
  };
  const taught = teachingDoc();
  const backMatter = new Set(data.backMatter);
  // Larger than any score Sphinx gives (an index entry that equals the query scores 100).
  const SHIFT = 1000;

  // Sphinx 7.4's default weights (searchtools.js), plus the score function it calls for every result.
  window.Scorer = {
    score: (result) => {
      const [docname, , , , score] = result;
      if (docname === taught) return score + SHIFT;
      if (backMatter.has(docname)) return score - SHIFT;
      return score;
    },
    objNameMatch: 11,
    objPartialMatch: 6,
    objPrio: {0: 15, 1: 5, 2: -5},
    objPrioDefault: 0,
    title: 15,
    partialTitle: 7,
    term: 5,
    partialTerm: 2,
  };

  // Sphinx fetches each result page for its excerpt, which fails from file://. Answer those requests from
  // the excerpts written at build time (the same text, as HTML with the pages' section and term ids).
  const contentRoot = document.documentElement.dataset.content_root || "";
  const suffix = (window.DOCUMENTATION_OPTIONS && DOCUMENTATION_OPTIONS.FILE_SUFFIX) || ".html";
  const pages = new Map(Object.keys(data.excerpts).map(
    (docname) => [new URL(contentRoot + docname + suffix, window.location.href).href, docname]));
  const networkFetch = window.fetch.bind(window);
  window.fetch = (resource, options) => {
    const url = new URL(resource instanceof Request ? resource.url : String(resource), window.location.href);
    const docname = pages.get(url.href);
    if (docname === undefined) return networkFetch(resource, options);
    const html = `<!doctype html><html><body><main role="main">${data.excerpts[docname]}</main></body></html>`;
    return Promise.resolve(new Response(html, {status: 200, headers: {"Content-Type": "text/html"}}));
  };
})();
