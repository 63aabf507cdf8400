// SPDX-License-Identifier: Apache-2.0
// Deterministic tasks: RULER-style needle-in-a-haystack (single, multi-key, multi-value,
// multi-query), variable tracking and common-word extraction, and questions about the haystack
// (an essay-like text generated from word lists), perplexity over a
// licence text Debian ships, and greedy agreement with the dense arm.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <fstream>
#include <random>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer.hpp"

namespace smollm {

struct niah_item {
  std::string task;  // one of niah_task_names()
  int target = 0;    // nominal length in tokens (1024, 2048, 4096, 8192)
  int index = 0;
  std::vector<std::int32_t> prompt;
  std::vector<std::string> answers;  // every one must appear in the output
  int max_new = 0;
  // The prompt's text before SmolLM2's chat template and tokenizer: prompt = encode(
  // chat_prompt(user) + answer_prefix). Another model re-tokenizes these with its own template
  // (bench/gpu/needle_suite.py --retokenize); the haystack is sized by SmolLM2's tokenizer.
  std::string user, answer_prefix;
};

namespace detail {

inline const std::vector<std::string>& words(int which) {
  static const std::vector<std::string> lists[] = {
      // subjects
      {"The committee", "A traveller", "The old gardener", "Our neighbour", "The engineer",
       "A young painter", "The village council", "The harbour master", "A careful reader",
       "The baker", "The museum guide", "A retired teacher", "The night watchman", "The farmer",
       "A quiet student", "The ferry captain"},
      // verbs
      {"described", "remembered", "questioned", "repaired", "admired", "studied", "carried",
       "painted", "measured", "explained", "collected", "followed", "ignored", "organised",
       "visited", "photographed"},
      // objects
      {"the narrow bridge", "an unusual clock", "the winter market", "a field of barley",
       "the stone tower", "a box of letters", "the eastern road", "an abandoned mill",
       "the public library", "a broken lantern", "the river bank", "a collection of maps",
       "the annual festival", "a wooden boat", "the city walls", "a row of chestnut trees"},
      // clauses
      {"before the first snow arrived", "while the bells were ringing",
       "after a long and dusty journey", "because nobody else had time",
       "during the quiet hours of the morning", "as the tide slowly turned",
       "without saying a single word", "in spite of the heavy rain", "when the lamps were lit",
       "long after the guests had left", "under a pale and cloudy sky", "with surprising patience",
       "near the end of the summer", "as everyone had expected", "for reasons nobody understood",
       "just before the market closed"},
      // key words (adjective, noun) for needle keys
      {"amber", "silent", "crimson", "hollow", "gentle", "frozen", "golden", "wild", "ancient",
       "bright", "velvet", "distant", "shy", "rapid", "marble", "copper"},
      {"falcon", "meadow", "harbor", "lantern", "orchard", "canyon", "willow", "comet", "garden",
       "river", "tower", "forest", "island", "valley", "beacon", "glacier"},
      // names and things of the question-answering facts (never in a haystack sentence)
      {"Ortega", "Ingrid", "Mateo", "Priya", "Tomasz", "Aiko", "Bruno", "Leila", "Yusuf", "Greta",
       "Nikolai", "Amara", "Dmitri", "Sofia", "Kwame", "Elena"},
      {"the copper weathervane", "the lighthouse ledger", "the velvet curtain",
       "the brass telescope", "the glass harmonica", "the silver compass", "the marble chessboard",
       "the oak cabinet", "the porcelain teapot", "the iron kettle", "the silk banner",
       "the clay oven", "the tin whistle", "the linen map", "the walnut desk", "the pewter jug"},
  };
  return lists[which];
}

template <class Rng>
const std::string& pick(Rng& rng, const std::vector<std::string>& v) {
  return v[std::uniform_int_distribution<std::size_t>(0, v.size() - 1)(rng)];
}

// Appends draw()'s first result that v does not hold yet.
template <class Draw>
void push_distinct(std::vector<std::string>& v, Draw draw) {
  std::string w;
  do {
    w = draw();
  } while (std::find(v.begin(), v.end(), w) != v.end());
  v.push_back(std::move(w));
}

template <class Rng>
std::string sentence(Rng& rng) {
  std::string s = pick(rng, words(0)) + " " + pick(rng, words(1)) + " " + pick(rng, words(2)) +
                  " " + pick(rng, words(3)) + ".";
  if (std::uniform_int_distribution<int>(0, 3)(rng) == 0) s += "\n";
  return s;
}

}  // namespace detail

// The task names make_niah_item knows: the four needle tasks (the default profile), then
// RULER's variable tracking and common-word extraction, and questions about the haystack itself.
inline const std::vector<std::string>& niah_task_names() {
  static const std::vector<std::string> names{"single",   "multikey", "multivalue", "multiquery",
                                              "vartrack", "cwe",      "qa"};
  return names;
}
// The default profile's tasks: the first ones of niah_task_names() (the four needle tasks).
inline constexpr std::ptrdiff_t niah_default_tasks = 4;

namespace detail {

// RULER's variable names: five capital letters.
template <class Rng>
std::string variable_name(Rng& rng) {
  std::string v;
  for (int i = 0; i < 5; ++i) v += char('A' + std::uniform_int_distribution<int>(0, 25)(rng));
  return v;
}

// Pseudo-words for the word list (three consonant-vowel syllables: about 2-3 tokens each); a
// list of 2000 entries needs far more distinct words than any fixed English list here holds.
template <class Rng>
std::string pseudo_word(Rng& rng) {
  static const std::string consonants = "bdfgklmnprstvz", vowels = "aeiou";
  std::string w;
  for (int i = 0; i < 3; ++i) {
    w += consonants[std::uniform_int_distribution<std::size_t>(0, consonants.size() - 1)(rng)];
    w += vowels[std::uniform_int_distribution<std::size_t>(0, vowels.size() - 1)(rng)];
  }
  return w;
}

// The text of a prompt: head, the haystack with `inserts` before the sentences `at` names, the
// question. Grows the haystack sentence by sentence (token counts are additive to a few tokens)
// until the prompt fills `budget` tokens, places the inserts (in their order) at sorted random
// sentence positions, then trims until the whole prompt fits.
template <class Rng>
void fill_haystack(niah_item& item, const tokenizer& tok, Rng& rng, int budget,
                   const std::string& head, const std::vector<std::string>& inserts,
                   const std::string& question) {
  auto build = [&](const std::vector<std::string>& hay, const std::vector<std::size_t>& at) {
    std::string body;
    std::size_t ni = 0;
    for (std::size_t s = 0; s <= hay.size(); ++s) {
      while (ni < at.size() && at[ni] == s) body += " " + inserts[ni++];
      if (s < hay.size()) body += " " + hay[s];
    }
    item.user = head + body + "\n" + question;
    return tok.encode(chat_prompt(item.user) + item.answer_prefix);
  };
  std::vector<std::string> hay;
  int approx = int(build({}, {}).size());
  while (approx < budget) {
    hay.push_back(sentence(rng));
    approx += int(tok.encode(" " + hay.back(), false).size());
  }
  std::vector<std::size_t> at(inserts.size());
  for (auto& a : at) a = std::uniform_int_distribution<std::size_t>(0, hay.size())(rng);
  std::sort(at.begin(), at.end());
  item.prompt = build(hay, at);
  while (int(item.prompt.size()) > budget && !hay.empty()) {
    const int over = int(item.prompt.size()) - budget;
    const std::size_t drop = std::max<std::size_t>(1, std::size_t(over / 14));
    hay.resize(hay.size() - std::min(drop, hay.size()));
    for (auto& a : at) a = std::min(a, hay.size());
    item.prompt = build(hay, at);
  }
}

// Common-word extraction (RULER's cwe): a numbered list in which 10 words appear c times each
// (c = 3% of the entries, at least 5) and every other word 1-3 times, so the 10 are strictly
// the most frequent; the list is as long as the budget allows, and at least 100 entries.
template <class Rng>
void fill_word_list(niah_item& item, const tokenizer& tok, Rng& rng, int budget) {
  const std::string head =
      "Below is a numbered list of words. Some of the words appear more often than the others. "
      "Memorize the ones that appear most often.\n";
  const std::string question = "What are the 10 most common words in the list above?";
  std::vector<std::string> common;
  while (common.size() < 10) push_distinct(common, [&] { return pseudo_word(rng); });
  item.answers = common;
  const Rng start = rng;  // every attempt at a length draws the same words
  auto build = [&](int n) {
    Rng r = start;
    const int c = std::max(5, n * 3 / 100);
    std::vector<std::string> entries;
    if (n > 0)
      for (const auto& w : common) entries.insert(entries.end(), std::size_t(c), w);
    std::vector<std::string> rare;
    while (int(entries.size()) < n) {
      std::string w = pseudo_word(r);
      if (std::find(common.begin(), common.end(), w) != common.end() ||
          std::find(rare.begin(), rare.end(), w) != rare.end())
        continue;
      rare.push_back(w);
      const int k = std::min(std::uniform_int_distribution<int>(1, 3)(r), n - int(entries.size()));
      entries.insert(entries.end(), std::size_t(k), w);
    }
    std::shuffle(entries.begin(), entries.end(), r);
    std::string body;
    for (std::size_t i = 0; i < entries.size(); ++i)
      body += (i ? " " : "") + std::to_string(i + 1) + ". " + entries[i];
    item.user = head + body + "\n" + question;
    return tok.encode(chat_prompt(item.user) + item.answer_prefix);
  };
  // Entries cost about the same number of tokens each: a few secant steps on n towards the
  // budget, then trim until the prompt fits.
  const int fixed = int(build(0).size());  // head and question only
  int n = 200;
  for (int step = 0; step < 6; ++step) {
    item.prompt = build(n);
    const int size = int(item.prompt.size());
    if (size <= budget && size > budget - 24) break;
    n = std::max(100, int(double(n) * double(budget - fixed) / double(size - fixed)));
  }
  item.prompt = build(n);
  while (int(item.prompt.size()) > budget && n > 100) {
    n = std::max(100, n - std::max(1, (int(item.prompt.size()) - budget) / 6));
    item.prompt = build(n);
  }
}

}  // namespace detail

// Items of one task at one length; generation depends only on (seed, task, target, index).
// Throws std::invalid_argument for a task niah_task_names() does not hold.
inline niah_item make_niah_item(const tokenizer& tok, const std::string& task, int target,
                                int index, std::uint64_t seed) {
  const auto& known = niah_task_names();
  if (std::find(known.begin(), known.end(), task) == known.end())
    throw std::invalid_argument("make_niah_item: unknown task '" + task + "'");
  std::seed_seq ss{std::uint32_t(seed), std::uint32_t(seed >> 32), std::uint32_t(target),
                   std::uint32_t(index), std::uint32_t(std::hash<std::string>{}(task))};
  std::mt19937_64 rng(ss);
  auto value = [&] {
    return std::to_string(std::uniform_int_distribution<int>(1000000, 9999999)(rng));
  };
  niah_item item;
  item.task = task;
  item.target = target;
  item.index = index;

  if (task == "vartrack") {  // RULER's variable tracking: one chain of four hops
    item.max_new = 64;
    const std::string v = value();
    std::vector<std::string> vars;
    while (vars.size() < 5) detail::push_distinct(vars, [&] { return detail::variable_name(rng); });
    std::vector<std::string> inserts{"VAR " + vars[0] + " = " + v + "."};
    for (std::size_t i = 1; i < vars.size(); ++i)
      inserts.push_back("VAR " + vars[i] + " = " + vars[i - 1] + ".");
    item.answers = vars;
    item.answer_prefix =
        "According to the chain of assignments in the text, the variables that "
        "are assigned the value " +
        v + " are:";
    detail::fill_haystack(
        item, tok, rng, target - item.max_new - 16,
        "Memorize and track the chain of variable assignments hidden in the following text.\n",
        inserts, "Find all variables that are assigned the value " + v + " in the text above.");
    return item;
  }
  if (task == "cwe") {
    item.max_new = 96;  // ten 2-3 token words, possibly numbered
    item.answer_prefix = "The 10 most common words in the list are:";
    detail::fill_word_list(item, tok, rng, target - item.max_new - 16);
    return item;
  }
  if (task == "qa") {  // four facts (a name did a thing) in the haystack, one asked
    item.max_new = 64;
    std::vector<std::string> names, things, deeds, inserts;
    for (int i = 0; i < 4; ++i) {
      detail::push_distinct(names, [&] { return detail::pick(rng, detail::words(6)); });
      detail::push_distinct(things, [&] { return detail::pick(rng, detail::words(7)); });
      deeds.push_back(detail::pick(rng, detail::words(1)) + " " + things.back());
      inserts.push_back(names.back() + " " + deeds.back() + ".");
    }
    const std::size_t q = std::uniform_int_distribution<std::size_t>(0, 3)(rng);
    const std::string& deed = deeds[q];
    item.answers = {names[q]};
    item.answer_prefix = "The name of the person who " + deed + " is";
    detail::fill_haystack(
        item, tok, rng, target - item.max_new - 16,
        "Read the following text carefully. I will ask you a question about it afterwards.\n",
        inserts, "What is the name of the person who " + deed + " in the provided text?");
    return item;
  }

  // The needle tasks: (key, value) needles and the queried keys.
  auto key = [&] {
    return detail::pick(rng, detail::words(4)) + "-" + detail::pick(rng, detail::words(5));
  };
  std::vector<std::pair<std::string, std::string>> needles;
  std::vector<std::string> queried;
  const int n_needles = task == "single" ? 1 : 4;
  std::vector<std::string> keys;
  while (int(keys.size()) < (task == "multivalue" ? 1 : n_needles))
    detail::push_distinct(keys, key);
  for (int i = 0; i < n_needles; ++i) {
    std::string v;
    do {
      v = value();
    } while (std::any_of(needles.begin(), needles.end(), [&](auto& nv) { return nv.second == v; }));
    needles.push_back({task == "multivalue" ? keys[0] : keys[std::size_t(i)], v});
  }
  if (task == "single" || task == "multikey") {
    const std::size_t q =
        task == "single" ? 0 : std::uniform_int_distribution<std::size_t>(0, 3)(rng);
    queried = {needles[q].first};
    item.answers = {needles[q].second};
  } else if (task == "multivalue") {
    queried = {keys[0]};
    for (auto& nv : needles) item.answers.push_back(nv.second);
  } else {  // multiquery: two of the four keys
    std::vector<std::size_t> idx{0, 1, 2, 3};
    std::shuffle(idx.begin(), idx.end(), rng);
    queried = {needles[idx[0]].first, needles[idx[1]].first};
    item.answers = {needles[idx[0]].second, needles[idx[1]].second};
  }
  std::string question;
  if (task == "single" || task == "multikey") {
    question =
        "What is the special magic number for " + queried[0] + " mentioned in the provided text?";
    item.answer_prefix =
        "The special magic number for " + queried[0] + " mentioned in the provided text is";
  } else if (task == "multivalue") {
    question = "What are all the special magic numbers for " + queried[0] +
               " mentioned in the provided text?";
    item.answer_prefix =
        "The special magic numbers for " + queried[0] + " mentioned in the provided text are";
  } else {
    question = "What are all the special magic numbers for " + queried[0] + " and " + queried[1] +
               " mentioned in the provided text?";
    item.answer_prefix = "The special magic numbers for " + queried[0] + " and " + queried[1] +
                         " mentioned in the provided text are";
  }
  item.max_new = task == "single" || task == "multikey" ? 16 : 48;
  std::vector<std::string> inserts;
  for (const auto& [k, v] : needles)
    inserts.push_back("One of the special magic numbers for " + k + " is: " + v + ".");
  detail::fill_haystack(item, tok, rng, target - item.max_new - 16,
                        "A special magic number is hidden within the following text. Make sure "
                        "to memorize it. I will quiz you about the number afterwards.\n",
                        inserts, question);
  return item;
}

// The fraction of the answers that appear in the output, ignoring ASCII case ("Old gardener"
// answers "old gardener"; digits are unaffected). bench/gpu/needle_suite.py's score() agrees.
inline double niah_score(const niah_item& item, const std::string& output) {
  auto lower = [](std::string s) {
    for (char& c : s)
      if (c >= 'A' && c <= 'Z') c = char(c - 'A' + 'a');
    return s;
  };
  const std::string out = lower(output);
  int found = 0;
  for (const auto& a : item.answers) found += out.find(lower(a)) != std::string::npos ? 1 : 0;
  return double(found) / double(item.answers.size());
}

inline std::string read_text_file(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Token ids written by another tokenizer (bench/gpu/ppl_suite.py ids: one decimal id per
// whitespace-separated field), so that a cross-path check feeds every path the same tokens.
inline std::vector<std::int32_t> read_token_ids(const std::string& path, std::int32_t vocab) {
  std::ifstream in(path);
  if (!in) throw std::runtime_error("cannot read " + path);
  std::vector<std::int32_t> ids;
  std::string field;
  while (in >> field) {
    std::size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(field, &used);
    } catch (const std::exception&) {
      used = 0;
    }
    if (used != field.size() || v < 0 || v >= vocab)
      throw std::runtime_error(path + ": token id '" + field + "' is not an integer in [0, " +
                               std::to_string(vocab) + ")");
    ids.push_back(std::int32_t(v));
  }
  if (ids.empty()) throw std::runtime_error(path + ": no token ids");
  return ids;
}

}  // namespace smollm
