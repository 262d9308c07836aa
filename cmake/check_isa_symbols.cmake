# ctest: fails if an ISA translation unit defines any symbol outside its own namespace
# (roundpipe::<isa>::...) other than its table accessor roundpipe::detail::<isa>_kernels().
# A template or inline function instantiated there with that ISA's flags (std::vector code, a
# shared helper) would be a weak symbol the linker may pick for every caller — the ODR trap that
# runs AVX-512 code on a CPU without it. Usage: cmake -DNM=nm -DISA=avx2 -DOBJECTS=a.o;b.o -P this
foreach(obj IN LISTS OBJECTS)
  execute_process(COMMAND ${NM} -C --defined-only ${obj} OUTPUT_VARIABLE out RESULT_VARIABLE rc)
  if(NOT rc EQUAL 0)
    message(FATAL_ERROR "${NM} failed on ${obj}")
  endif()
  string(REPLACE "\n" ";" lines "${out}")
  set(leaks "")
  foreach(line IN LISTS lines)
    # Only symbols the linker can see matter: global (upper-case type) or weak (W, V, u).
    if(line MATCHES "^[0-9a-f]+ ([A-Zuvw]) (.*)$")
      set(name "${CMAKE_MATCH_2}")
      # (a function template's instantiation is printed with its return type first)
      if(NOT name MATCHES "^([A-Za-z_0-9]+ )?roundpipe::${ISA}::" AND
         NOT name MATCHES "^roundpipe::detail::${ISA}_kernels\\(\\)")
        list(APPEND leaks "  ${line}")
      endif()
    endif()
  endforeach()
  if(leaks)
    string(REPLACE ";" "\n" leaks "${leaks}")
    message(FATAL_ERROR "ISA ${ISA}: ${obj} defines symbols outside roundpipe::${ISA}:\n${leaks}")
  endif()
  message(STATUS "ISA ${ISA}: ${obj}: every visible symbol is in roundpipe::${ISA}")
endforeach()
